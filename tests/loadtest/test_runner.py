"""Whole runs against the fake OpenAI server on 127.0.0.1, with injected and known delays.

Timing bounds are generous on purpose (2 shared, loaded cores): a measured latency may never be
below what the server injected, and may exceed it by a loaded machine's scheduling noise.
"""

import time

import numpy as np
import pytest

from kvserve.loadtest.arrivals import ArrivalProcess
from kvserve.loadtest.datasets import BenchRequest, RandomDataset
from kvserve.loadtest.metrics import compute_metrics
from kvserve.loadtest.records import ErrorKind
from kvserve.loadtest.runner import BenchmarkError

from .conftest import endpoint_for, run
from .fake_openai_server import Behaviour

SLACK_S = 0.15


def test_counts_are_exact(fake_server) -> None:
    requests = RandomDataset(input_len=12, output_len=6, range_ratio=0.5).sample(15, seed=0)
    with fake_server() as server:
        result = run(endpoint_for(server, ignore_eos=True), requests, num_warmups=2)
    metrics = compute_metrics(result)
    assert len(server.bodies) == 15 + 2  # the warm-ups plus exactly --num-prompts
    assert all(body["ignore_eos"] for body in server.bodies)
    assert (metrics.completed, metrics.failed, metrics.cancelled, metrics.not_sent) == (15, 0, 0, 0)
    assert metrics.total_output_tokens == sum(r.output_len for r in requests)
    assert metrics.total_input_tokens == sum(r.prompt_len for r in requests)
    assert all(r.content_chunks == r.output_tokens for r in result.records)
    assert metrics.latencies["itl"].count == sum(r.output_len - 1 for r in requests)
    assert metrics.usage_mismatches == 0 and not result.hit_duration_cap


def test_latency_percentiles_match_the_injected_delays(fake_server) -> None:
    ttft, itl, tokens = 0.2, 0.03, 6
    requests = [BenchRequest(prompt="a b c", prompt_len=3, output_len=tokens)] * 8
    with fake_server(lambda i, body: Behaviour(ttft_s=ttft, itl_s=itl)) as server:
        metrics = compute_metrics(run(endpoint_for(server), requests, num_warmups=1), percentiles=(50, 90, 99))
    lat = {name: metrics.latencies[name] for name in ("ttft", "itl", "tpot", "e2el")}
    assert ttft * 1e3 <= lat["ttft"].median_ms <= (ttft + SLACK_S) * 1e3
    assert ttft * 1e3 <= lat["ttft"].percentiles_ms[99] <= (ttft + 2 * SLACK_S) * 1e3
    # A single ITL gap can come out short if two chunks land in one read; the median cannot.
    assert itl * 1e3 * 0.9 <= lat["itl"].median_ms <= (itl + SLACK_S / 3) * 1e3
    assert itl * 1e3 * 0.9 <= lat["tpot"].median_ms <= (itl + SLACK_S / 3) * 1e3
    expected_e2e = ttft + (tokens - 1) * itl
    assert expected_e2e * 1e3 <= lat["e2el"].median_ms <= (expected_e2e + 2 * SLACK_S) * 1e3
    assert metrics.total_output_tokens == 8 * tokens


def test_errors_are_counted_by_type(fake_server) -> None:
    def behaviour(i: int, body: dict) -> Behaviour:
        return [Behaviour(), Behaviour(status=500), Behaviour(status=503), Behaviour(disconnect_after=2)][i % 4]

    requests = [BenchRequest(prompt="x y", prompt_len=2, output_len=4)] * 12
    with fake_server(behaviour) as server:
        metrics = compute_metrics(run(endpoint_for(server), requests, max_concurrency=1))
    assert metrics.completed == 3 and metrics.failed == 9
    assert metrics.errors_by_type == {"disconnect": 3, "http_500": 3, "http_503": 3}
    assert metrics.total_output_tokens == 3 * 4  # tokens of failed requests do not count


def test_request_timeout_is_an_error_not_a_hang(fake_server) -> None:
    requests = [BenchRequest(prompt="x", prompt_len=1, output_len=3)] * 3
    with fake_server(lambda i, body: Behaviour(ttft_s=30.0)) as server:
        started = time.perf_counter()
        result = run(endpoint_for(server, request_timeout_s=0.3), requests)
    assert time.perf_counter() - started < 10
    assert [r.error for r in result.records] == [ErrorKind.TIMEOUT] * 3


def test_max_concurrency_caps_requests_in_flight(fake_server) -> None:
    requests = [BenchRequest(prompt="x", prompt_len=1, output_len=3)] * 8
    with fake_server(lambda i, body: Behaviour(ttft_s=0.05, itl_s=0.01)) as server:
        result = run(endpoint_for(server), requests, max_concurrency=2)
    assert server.max_in_flight == 2
    assert len(result.records) == 8


def test_run_stops_at_the_duration_cap_and_accounts_for_every_request(fake_server) -> None:
    # At 4 req/s, 40 requests would need ~10 s; the cap ends the run after 1 s.
    requests = [BenchRequest(prompt="x", prompt_len=1, output_len=2)] * 40
    with fake_server(lambda i, body: Behaviour(ttft_s=0.01)) as server:
        started = time.perf_counter()
        result = run(endpoint_for(server), requests, arrivals=ArrivalProcess(request_rate=4.0), duration_s=1.0)
        elapsed = time.perf_counter() - started
    assert result.hit_duration_cap and result.duration_s == pytest.approx(1.0)
    assert elapsed < 6
    assert 1 <= len(result.records) < 40 and result.not_sent > 0
    assert len(result.records) + result.cancelled + result.not_sent == 40
    # A request cancelled at the cap may have left the client before or after its bytes did, so
    # the server saw every finished request and at most every cancelled one, never a request
    # counted as not sent.
    assert len(result.records) <= len(server.bodies) <= len(result.records) + result.cancelled


def test_requests_in_flight_at_the_cap_are_cancelled_and_counted(fake_server) -> None:
    requests = [BenchRequest(prompt="x", prompt_len=1, output_len=2)] * 5
    with fake_server(lambda i, body: Behaviour(ttft_s=20.0)) as server:
        result = run(endpoint_for(server), requests, duration_s=0.5)
        metrics = compute_metrics(result)
    assert (result.cancelled, result.not_sent, len(result.records)) == (5, 0, 0)
    assert metrics.completed == 0 and metrics.latencies["ttft"].mean_ms is None


def test_poisson_run_sends_at_the_requested_rate(fake_server) -> None:
    # The schedule is seeded, so the expected span is known exactly. Every send may only be late,
    # the first one included, so the span from the first send to the last may come out short by
    # the first send's lateness (CI measured 0.2 ms) or long by the last one's.
    rate, n = 20.0, 20
    requests = [BenchRequest(prompt="x", prompt_len=1, output_len=1)] * n
    with fake_server() as server:
        result = run(endpoint_for(server), requests, arrivals=ArrivalProcess(request_rate=rate), seed=5)
    starts = np.sort([r.start_s for r in result.records])
    planned = ArrivalProcess(request_rate=rate).offsets(n, seed=5)
    assert planned[-1] - SLACK_S <= starts[-1] - starts[0] <= planned[-1] + SLACK_S * 2


def test_a_failing_warm_up_stops_the_run_with_the_reason(fake_server) -> None:
    requests = [BenchRequest(prompt="x", prompt_len=1, output_len=1)]
    with fake_server(lambda i, body: Behaviour(status=401)) as server:
        with pytest.raises(BenchmarkError, match="http_401.*--api-key"):
            run(endpoint_for(server), requests, num_warmups=1)
    assert len(server.bodies) == 1
