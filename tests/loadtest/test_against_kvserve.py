"""kvserve-bench against a real kvserve server (a subprocess loading SmolLM2), with a tiny workload.

The fake-server tests pin the client's arithmetic; this one checks the two halves agree on the
wire: token-id prompts, ignore_eos, streamed chunks and usage all line up, nothing fails.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.loadtest import Endpoint, LoadConfig, RandomDataset, compute_metrics, run_load
from kvserve.loadtest.cli import main as bench_main
from tests.process_harness import background_process, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STARTUP_TIMEOUT_S = 300.0
NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN = 6, 24, 8


@pytest.fixture(scope="module")
def kvserve_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base_url, model) of a small kvserve server; the server is always stopped afterwards."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "64", "--max-num-seqs", "8",
            "--no-enable-prefix-caching", "--log-level", "warning"]
    log_path = tmp_path_factory.mktemp("kvserve") / "server.log"
    with background_process(argv, log_path, f"{base_url}/v1/models", startup_timeout_s=STARTUP_TIMEOUT_S):
        model = httpx.get(f"{base_url}/v1/models", timeout=5.0, trust_env=False).json()["data"][0]["id"]
        yield base_url, model


def test_run_load_counts_every_token_of_a_tiny_workload(kvserve_server: tuple[str, str]) -> None:
    base_url, model = kvserve_server
    requests = RandomDataset(input_len=INPUT_LEN, output_len=OUTPUT_LEN, token_ids=True, vocab_size=49152,
                             first_token_id=17).sample(NUM_REQUESTS, seed=0)
    endpoint = Endpoint(base_url=base_url, model=model, ignore_eos=True, request_timeout_s=240.0)
    load = LoadConfig(duration_s=300.0, num_warmups=1, show_progress=False)

    run = asyncio.run(run_load(endpoint, requests, load))
    metrics = compute_metrics(run)

    assert (metrics.completed, metrics.failed, metrics.cancelled, metrics.not_sent) == (NUM_REQUESTS, 0, 0, 0)
    assert metrics.errors_by_type == {}
    assert not metrics.hit_duration_cap
    assert metrics.total_input_tokens == NUM_REQUESTS * INPUT_LEN  # the server's usage, token ids are exact
    assert metrics.total_output_tokens == NUM_REQUESTS * OUTPUT_LEN  # ignore_eos: every max_tokens generated
    for record in run.records:
        assert record.usage_completion_tokens == OUTPUT_LEN
        assert 1 <= record.content_chunks <= OUTPUT_LEN
        assert len(record.itl_s) == record.content_chunks - 1
        assert record.ttft_s is not None and record.e2e_s is not None and 0 < record.ttft_s <= record.e2e_s
    assert metrics.latencies["ttft"].count == NUM_REQUESTS
    assert metrics.latencies["tpot"].count == NUM_REQUESTS


def test_cli_saves_a_vllm_style_result(kvserve_server: tuple[str, str], tmp_path: Path) -> None:
    base_url, _ = kvserve_server
    code = bench_main([
        "--base-url", base_url, "--dataset-name", "random", "--random-prompt-format", "token-ids",
        "--random-input-len", "16", "--random-output-len", "4", "--random-vocab-size", "49152",
        "--num-prompts", "3", "--ignore-eos", "--num-warmups", "0", "--duration", "240", "--disable-tqdm",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json",
    ])

    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (3, 0)
    assert result["total_input_tokens"] == 3 * 16
    assert result["total_output_tokens"] == 3 * 4
    assert result["request_rate"] == "inf"
    assert result["mean_ttft_ms"] > 0 and result["output_throughput"] > 0
