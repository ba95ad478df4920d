"""Soak and faults against one real `kvserve serve` process (the real engine over a tiny random
model, so thousands of requests fit in minutes). Opt-in: `pytest -m soak tests/soak -s` (the
summary line with the figures is printed).

- 2 x 1,500 mixed requests after a warm-up: streams, n > 1, stop strings, chat, tokenize, random
  client disconnects, client timeouts and bad inputs. Afterwards: no 5xx (seen by clients or
  counted in /metrics), every bad input a 4xx, every hang-up counted as 499 and its request as
  finished "abort", no KV block leaked, running/waiting gauges 0. RSS is reported after the
  warm-up and after each half; the second half's growth is bounded (memory must level off: the
  CPU libraries' per-shape caches are capped, engine/cpu_caches.py).
- An exception inside a model step fails the in-flight requests (500 / an error event, counted
  as a 5xx), never hangs them, and /health turns 503 within 5 s.
- SIGTERM during a burst: every request ends (finished, aborted, or refused with 503) and the
  process exits 0 within the grace period.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.process_harness import background_process, free_port
from tests.server.tiny_checkpoint import write_tiny_checkpoint

pytestmark = [pytest.mark.soak, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WARMUP_REQUESTS = 300
HALF_REQUESTS = 1500
CONCURRENCY = 16
# Bounded, not timed. Over the first half caches fill (allocator pools, the capped per-shape
# caches); over the second, memory must have levelled off: a leak of 20 KiB/request fails.
MAX_SECOND_HALF_GROWTH_MIB = 30
MAX_RSS_GROWTH_MIB = 150
NUM_KV_BLOCKS = 256  # as soak_server_main configures


@contextmanager
def soak_server(tmp_path: Path, grace_s: float) -> Iterator[tuple[str, object, Path]]:
    model = write_tiny_checkpoint(tmp_path / "tiny")
    port = free_port()
    fault_file = tmp_path / "fault"
    argv = [sys.executable, "-m", "tests.soak.soak_server_main", str(model), str(port), str(fault_file), str(grace_s)]
    url = f"http://127.0.0.1:{port}"
    with background_process(argv, tmp_path / "server.log", f"{url}/health", startup_timeout_s=600) as running:
        yield url, running, fault_file


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def counters(url: str) -> dict[str, float]:
    """5xx answers counted (errors and access metrics), 499s, and requests finished "abort"."""
    found = {"5xx": 0.0, "http_5xx": 0.0, "499": 0.0, "aborted": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "kvserve_request_errors_total":
                code = sample.labels["code"]
                if code.startswith("5"):
                    found["5xx"] += sample.value
                elif code == "499":
                    found["499"] += sample.value
            elif sample.name == "kvserve_http_requests_total" and sample.labels["status"].startswith("5"):
                found["http_5xx"] += sample.value
            elif sample.name == "kvserve_request_success_total" and sample.labels["finished_reason"] == "abort":
                found["aborted"] += sample.value
    return found


def gauges(url: str) -> dict[str, float]:
    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in ("kvserve_num_requests_running", "kvserve_num_requests_waiting"):
                found[sample.name] = sample.value
            elif sample.name == "kvserve_kv_cache_blocks":
                found[sample.labels["state"]] = sample.value
    return found


def wait_idle(url: str, timeout_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = gauges(url)
        if found["kvserve_num_requests_running"] == 0 and found["kvserve_num_requests_waiting"] == 0 \
                and found["used"] == 0:
            return found
        assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {found}"
        time.sleep(0.2)


BAD_INPUTS = [
    ("/v1/completions", {"prompt": [[False]]}),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x" * 600, "max_tokens": 4}),  # longer than max_model_len
    ("/v1/completions", {"model": "not-served", "prompt": "a"}),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}),
    ("/detokenize", {"tokens": [10**9]}),
    ("/v1/completions", b"{not json"),
]


async def one_request(client: httpx.AsyncClient, rng: random.Random, outcomes: Counter, server_errors: list) -> None:
    kind = rng.choice(["complete", "complete", "stream", "stream", "chat", "chat_stream", "n", "stop",
                       "disconnect", "timeout", "bad", "tokenize"])
    prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 40)))
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.7, 1.0])}
    path = "/v1/completions"
    try:
        if kind == "bad":
            path, bad = rng.choice(BAD_INPUTS)
            response = await (client.post(path, content=bad, headers={"content-type": "application/json"})
                              if isinstance(bad, bytes) else client.post(path, json=bad))
            assert 400 <= response.status_code < 500, (path, bad, response.status_code, response.text)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            outcomes["bad_rejected"] += 1
            return
        if kind == "tokenize":
            response = await client.post("/tokenize", json={"prompt": prompt})
        elif kind in ("chat", "chat_stream"):
            path = "/v1/chat/completions"
            chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": body["max_tokens"],
                    "stream": kind == "chat_stream"}
            response = await client.post(path, json=chat)
        elif kind in ("stream", "disconnect"):
            async with client.stream("POST", path, json={**body, "max_tokens": rng.randint(8, 64),
                                                        "stream": True}) as response:
                keep = rng.randint(1, 4) if kind == "disconnect" else None
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if keep is not None and seen >= keep:
                        break  # hang up mid-stream
            outcomes[kind] += 1
            if response.status_code >= 500:
                server_errors.append((kind, response.status_code))
            return
        elif kind == "timeout":
            try:
                response = await client.post(path, json={**body, "max_tokens": 128, "ignore_eos": True},
                                             timeout=httpx.Timeout(30, read=0.05))
            except httpx.ReadTimeout:
                outcomes["timed_out"] += 1
                return
        elif kind == "n":
            response = await client.post(path, json={**body, "n": rng.randint(2, 3)})
        elif kind == "stop":
            response = await client.post(path, json={**body, "stop": ["a", "b c"], "max_tokens": 32})
        else:
            response = await client.post(path, json=body)
        if response.status_code >= 500:
            server_errors.append((kind, response.status_code, response.text[:300]))
        else:
            assert response.status_code == 200, (kind, response.status_code, response.text)
        outcomes[kind] += 1
    except httpx.TransportError as error:  # a dropped connection would be a server fault too
        server_errors.append((kind, repr(error)))


async def run_mixed(url: str, num_requests: int, seed: int) -> tuple[Counter, list]:
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    server_errors: list = []
    semaphore = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def guarded() -> None:
            async with semaphore:
                await one_request(client, rng, outcomes, server_errors)

        await asyncio.gather(*(guarded() for _ in range(num_requests)))
    return outcomes, server_errors


@pytest.mark.timeout(3600)  # 3,300 requests: minutes on an idle 2-core machine, far more on a busy one
def test_soak_then_an_injected_model_fault(tmp_path: Path) -> None:
    with soak_server(tmp_path, grace_s=5) as (url, running, fault_file):
        pid = running.process.pid
        asyncio.run(run_mixed(url, WARMUP_REQUESTS, seed=1))  # allocator pools, caches, lazy imports
        wait_idle(url)
        rss = [rss_mib(pid)]
        baseline = counters(url)  # (/health answered 503 while the model loaded: not the soak's)
        outcomes: Counter = Counter()
        server_errors: list = []
        started = time.monotonic()
        for half in range(2):
            half_outcomes, half_errors = asyncio.run(run_mixed(url, HALF_REQUESTS, seed=2 + half))
            outcomes += half_outcomes
            server_errors += half_errors
            idle = wait_idle(url)
            rss.append(rss_mib(pid))
        elapsed = time.monotonic() - started
        counted = {name: value - baseline[name] for name, value in counters(url).items()}
        print(f"\nsoak: 2 x {HALF_REQUESTS} requests in {elapsed:.1f} s ({2 * HALF_REQUESTS / elapsed:.1f} req/s), "
              f"outcomes {dict(sorted(outcomes.items()))}, server errors {len(server_errors)}, metrics {counted}, "
              f"RSS after {WARMUP_REQUESTS} warm-up requests {rss[0]:.1f} MiB, after the first half {rss[1]:.1f} "
              f"(+{rss[1] - rss[0]:.1f}), after the second {rss[2]:.1f} (+{rss[2] - rss[1]:.1f}); blocks at rest {idle}")
        assert server_errors == []
        assert sum(outcomes.values()) == 2 * HALF_REQUESTS
        assert idle["used"] == 0 and idle["free"] + idle["cached"] == NUM_KV_BLOCKS
        # Honest accounting: no 5xx for anything the clients did; their hang-ups are 499s and aborts.
        assert counted["5xx"] == 0 and counted["http_5xx"] == 0
        # (A client may give up just after its answer was complete: then neither a 499 nor an abort.)
        hung_up = outcomes["disconnect"] + outcomes["timed_out"]
        assert 0 < counted["499"] <= hung_up and 0 < counted["aborted"] <= hung_up
        assert rss[2] - rss[1] < MAX_SECOND_HALF_GROWTH_MIB
        assert rss[2] - rss[0] < MAX_RSS_GROWTH_MIB
        assert httpx.get(f"{url}/health").status_code == 200

        # --- an exception inside a model step, with requests in flight ---
        async def in_flight_then_fault() -> list:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                long = {"prompt": "fault", "max_tokens": 400, "ignore_eos": True}
                plain = [asyncio.create_task(client.post("/v1/completions", json=long)) for _ in range(2)]

                async def stream() -> list[str]:
                    async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
                        return [line async for line in response.aiter_lines() if line.startswith("data: ")]

                streams = [asyncio.create_task(stream()) for _ in range(2)]
                while gauges(url)["kvserve_num_requests_running"] < 4:
                    await asyncio.sleep(0.05)
                fault_file.touch()
                faulted_at = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*plain, *streams), timeout=30)
                health_503_after = None
                while time.monotonic() - faulted_at < 5:
                    if (await client.get("/health")).status_code == 503:
                        health_503_after = time.monotonic() - faulted_at
                        break
                    await asyncio.sleep(0.05)
                new = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                return [results, health_503_after, new]

        (plain_a, plain_b, stream_a, stream_b), health_503_after, new = asyncio.run(in_flight_then_fault())
        for response in (plain_a, plain_b):
            assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
        assert counters(url)["5xx"] - baseline["5xx"] >= 2  # a server fault does move the 5xx counters
        for lines in (stream_a, stream_b):
            events = [line.removeprefix("data: ") for line in lines if line != "data: [DONE]"]
            assert json.loads(events[-1])["error"]["code"] == "engine_error", lines[-3:]
        assert health_503_after is not None, "/health did not turn 503 within 5 s of the engine's death"
        assert new.status_code == 503
        print(f"fault: in-flight requests failed with 500 / error events; /health 503 after {health_503_after:.2f} s")


def test_sigterm_during_a_burst_drains_or_aborts_everything_and_exits_0(tmp_path: Path) -> None:
    grace_s = 3.0
    with soak_server(tmp_path, grace_s=grace_s) as (url, running, _fault_file):
        async def burst() -> list:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                async def request(i: int):
                    body = {"prompt": f"burst {i}", "max_tokens": 32 + 16 * (i % 16), "ignore_eos": True}
                    if i % 2:
                        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                        return ("stream", r.status_code, lines)
                    response = await client.post("/v1/completions", json=body)
                    return ("plain", response.status_code, response.json())

                tasks = [asyncio.create_task(request(i)) for i in range(48)]
                while gauges(url)["kvserve_num_requests_running"] == 0:
                    await asyncio.sleep(0.02)
                running.process.send_signal(signal.SIGTERM)
                signalled.append(time.monotonic())
                late = await asyncio.gather(*(request(100 + i) for i in range(4)), return_exceptions=True)
                return [await asyncio.wait_for(asyncio.gather(*tasks), timeout=grace_s + 30), late]

        signalled: list[float] = []
        results, late = asyncio.run(burst())
        exit_code = running.process.wait(timeout=grace_s + 30)
        stopped_after = time.monotonic() - signalled[0]
        reasons: Counter = Counter()
        for kind, status, payload in results:
            if status == 503:
                reasons["refused"] += 1
                continue
            assert status == 200, (kind, status, payload)
            if kind == "plain":
                reasons.update(choice["finish_reason"] for choice in payload["choices"])
            else:
                assert payload[-1] == "data: [DONE]", payload[-3:]
                last = [json.loads(p.removeprefix("data: ")) for p in payload[:-1]]
                reasons.update(c["finish_reason"] for chunk in last for c in chunk["choices"] if c["finish_reason"])
        for outcome in late:  # sent after SIGTERM: refused with 503, or the socket already closed
            assert isinstance(outcome, httpx.TransportError) or outcome[1] == 503, outcome
        print(f"\nsigterm: 48 requests mid-burst ended {dict(reasons)}; exit {exit_code} after {stopped_after:.1f} s")
        assert exit_code == 0
        assert stopped_after < grace_s + 10  # the grace period, then aborts and a bounded close
        assert sum(reasons.values()) == 48
        assert set(reasons) <= {"length", "abort", "refused"}
