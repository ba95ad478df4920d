"""Two kvserve replicas behind SGLang Model Gateway, on loopback.

The workload: 3 long prefixes (system prompts), 3 requests each. The first request of each
prefix is sent while the others are still running (staggered by a moment, so the gateway has
counted the earlier ones): cache-aware routing sends a request that matches no cached prefix to
the least-loaded replica, so the 3 prefixes spread over both. Then the remaining 6 go one at a
time in the order A B C A B C. Round-robin alternates each prefix between the 2 replicas (3 is
odd), so of each prefix's 2 follow-ups exactly one lands where the prefix is cached: 3 prefix
hits in 6. Cache-aware routing keeps each prefix where it is cached: 6 in 6. Both ratios come
from the replicas' own /metrics counters (prompt tokens looked up in, and found in, the cache):
about 1/3 against 2/3 of all prompt tokens.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvserve.loadtest.datasets import PrefixDataset
from tests.router.gateway_harness import Replica, gateway, gateway_binary, kvserve_replicas, wait_until_workers_healthy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.router,
    pytest.mark.skipif(gateway_binary() is None, reason="sglang-router is not installed (pip install -e '.[dev]')"),
]

MODEL = "SmolLM2-135M-Instruct"
PREFIX_WORDS = 300
NUM_PREFIXES = 3
REQUESTS_PER_PREFIX = 3


def _workload(seed: int) -> list[str]:
    dataset = PrefixDataset(prefix_len=PREFIX_WORDS, suffix_len=8, output_len=2, num_prefixes=NUM_PREFIXES)
    return [str(request.prompt) for request in dataset.sample(NUM_PREFIXES * REQUESTS_PER_PREFIX, seed)]


def _complete(gateway_url: str, prompt: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    return response


def _send(gateway_url: str, prompts: list[str]) -> None:
    first, rest = prompts[:NUM_PREFIXES], prompts[NUM_PREFIXES:]
    with ThreadPoolExecutor(NUM_PREFIXES) as pool:
        futures = []
        for prompt in first:  # a longer output keeps each one in flight while the next arrives
            futures.append(pool.submit(_complete, gateway_url, prompt, 16))
            time.sleep(0.1)
        for future in futures:
            future.result()
    for prompt in rest:
        _complete(gateway_url, prompt)


def _run(gateway_url: str, replicas: list[Replica], prompts: list[str]) -> tuple[float, list[float]]:
    """Sends the prompts; returns the prefix-cache hit ratio over all replicas and the prompt
    tokens each replica computed."""
    before = [replica.counters() for replica in replicas]
    _send(gateway_url, prompts)
    after = [replica.counters() for replica in replicas]

    def delta(name: str, index: int) -> float:
        return after[index].get(name, 0.0) - before[index].get(name, 0.0)

    indices = range(len(replicas))
    queries = sum(delta("kvserve_prefix_cache_queries_total", i) for i in indices)
    hits = sum(delta("kvserve_prefix_cache_hits_total", i) for i in indices)
    assert queries > 0
    return hits / queries, [delta("kvserve_prompt_tokens_total", i) for i in indices]


def test_cache_aware_routing_keeps_prefixes_together_and_survives_a_dead_replica(tmp_path: Path) -> None:
    with kvserve_replicas(tmp_path, 2, ["--num-kv-blocks", "512", "--max-num-seqs", "8"]) as replicas:
        urls = [replica.url for replica in replicas]
        # Fresh prefixes per policy (different seeds), so neither run profits from the other's cache.
        with gateway(tmp_path, urls, "round_robin") as url:
            round_robin_ratio, round_robin_work = _run(url, replicas, _workload(seed=1))
        with gateway(tmp_path, urls, "cache_aware") as url:
            cache_aware_ratio, cache_aware_work = _run(url, replicas, _workload(seed=2))
            assert all(work > 0 for work in cache_aware_work), f"a replica got no work: {cache_aware_work}"
            assert all(work > 0 for work in round_robin_work), f"a replica got no work: {round_robin_work}"
            # Expected about 2/3 against 1/3 (see the module docstring).
            assert cache_aware_ratio > round_robin_ratio + 0.2, (cache_aware_ratio, round_robin_ratio)

            replicas[0].kill()
            # Until its next health check (every second; one failure marks a worker down) the
            # gateway still routes the dead replica's prefixes to it, and retries go to the same
            # worker: those requests fail, as behind any health-checked balancer. Once the gateway
            # lists the dead replica as unhealthy, every request must succeed on the survivor.
            wait_until_workers_healthy(url, 1)
            for prompt in _workload(seed=3):
                _complete(url, prompt)
