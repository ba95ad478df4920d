"""/metrics gauges are true at every scrape: on a fresh server, and after clients hang up or time
out, with no later request to trigger an engine step. The real engine over a tiny random model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.scheduler import ModelRunnerOutput, SchedulerOutput
from kvserve.server.app import build_app
from kvserve.server.metrics import ServerMetrics
from kvserve.server.serve import metrics_info
from kvserve.server.settings import ServerSettings
from tests.server.live_server import live_server, wait_until
from tests.server.tiny_checkpoint import write_tiny_checkpoint

NUM_BLOCKS = 96
# The tiny model steps in a few milliseconds: slowed down, a long request is surely still running
# when its client hangs up, and the event loop is never starved by a busy engine thread.
STEP_DELAY_S = 0.01


def slow_down(runner: ModelRunner, delay_s: float) -> None:
    execute = runner.execute

    def slow_execute(output: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(delay_s)
        return execute(output)

    runner.execute = slow_execute  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, AsyncEngine]]:
    model = write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny")) / "tiny")
    config = EngineConfig(model=str(model), served_model_name="tiny", dtype="float32", device="cpu",
                          num_kv_blocks=NUM_BLOCKS, max_model_len=512)
    metrics = ServerMetrics("tiny", metrics_info(config))
    engine = AsyncEngine.from_config(config, [metrics])
    slow_down(engine.engine.executor.driver.runner, STEP_DELAY_S)
    engine.start()
    with live_server(build_app(engine, ServerSettings(), metrics=metrics)) as url:
        yield url, engine
    engine.shutdown()


def aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvserve_request_success_total" and s.labels["finished_reason"] == "abort"]
    return samples[0].value


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("kvserve_num_requests_running", "kvserve_num_requests_waiting",
                               "kvserve_kv_cache_usage_ratio"):
                values[sample.name] = sample.value
            elif sample.name == "kvserve_kv_cache_blocks":
                values[f"blocks_{sample.labels['state']}"] = sample.value
    return values


def wait_engine_idle(engine: AsyncEngine) -> None:
    wait_until(lambda: not engine.engine.has_unfinished_requests() and engine.num_unfinished_requests == 0,
               timeout=20)


LONG = {"model": "tiny", "prompt": "a long story", "max_tokens": 480, "ignore_eos": True}


def assert_idle(url: str) -> None:
    # The engine has finished the aborts; the gauges must say so without any further request.
    # (The published load lags the engine by at most one loop iteration, hence the short wait.)
    wait_until(lambda: gauges(url)["kvserve_num_requests_running"] == 0, timeout=5)
    found = gauges(url)
    assert found["kvserve_num_requests_running"] == 0
    assert found["kvserve_num_requests_waiting"] == 0
    assert found["blocks_used"] == 0
    assert found["kvserve_kv_cache_usage_ratio"] == 0
    assert found["blocks_free"] + found["blocks_cached"] == NUM_BLOCKS


def test_a_fresh_server_reports_every_block_free(server: tuple[str, AsyncEngine]) -> None:
    url, _engine = server
    found = gauges(url)
    assert found["blocks_free"] == NUM_BLOCKS
    assert found["blocks_used"] == 0 and found["blocks_cached"] == 0
    assert found["kvserve_num_requests_running"] == 0


def test_gauges_return_to_zero_after_streaming_clients_hang_up(server: tuple[str, AsyncEngine]) -> None:
    url, engine = server
    clients = [httpx.Client(base_url=url, timeout=30) for _ in range(4)]
    streams = [client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) for client in clients]
    responses = [stream.__enter__() for stream in streams]
    # Hold the line iterators: dropping one closes its response, which is the hang-up itself.
    lines = [response.iter_lines() for response in responses]
    assert all(next(line).startswith("data: ") for line in lines)
    wait_until(lambda: gauges(url)["kvserve_num_requests_running"] == 4, timeout=10)
    for stream, client in zip(streams, clients):
        stream.__exit__(None, None, None)
        client.close()
    wait_engine_idle(engine)
    assert_idle(url)
    assert aborted(url) == 4


def test_gauges_return_to_zero_after_a_client_timeout(server: tuple[str, AsyncEngine]) -> None:
    url, engine = server
    before = aborted(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**LONG, "n": 2}, timeout=httpx.Timeout(10, read=0.5))
    wait_engine_idle(engine)
    assert_idle(url)
    assert aborted(url) == before + 2
