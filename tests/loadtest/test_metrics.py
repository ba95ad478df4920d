"""Metrics and goodput on constructed records: exact arithmetic, no server."""

import json

import numpy as np
import pytest

from kvserve.loadtest.goodput import GoodputError, GoodputSLO
from kvserve.loadtest.metrics import compute_metrics
from kvserve.loadtest.records import ErrorKind, RequestRecord, RunResult
from kvserve.loadtest.report import format_table, save_result


def ok(ttft: float, tpot: float, tokens: int, prompt: int = 10) -> RequestRecord:
    e2e = ttft + tpot * (tokens - 1)
    return RequestRecord(start_s=0.0, prompt_len=prompt, output_tokens=tokens, content_chunks=tokens,
                         usage_completion_tokens=tokens, ttft_s=ttft, itl_s=(tpot,) * (tokens - 1), e2e_s=e2e)


def failed(kind: ErrorKind, status: int | None = None) -> RequestRecord:
    return RequestRecord(start_s=0.0, prompt_len=10, e2e_s=0.1, error=kind, status_code=status)


def result(*records: RequestRecord, duration: float = 10.0) -> RunResult:
    return RunResult(records=records, cancelled=0, not_sent=0, duration_s=duration, hit_duration_cap=False)


def test_goodput_counts_requests_meeting_every_objective() -> None:
    records = (
        ok(ttft=0.1, tpot=0.02, tokens=5),  # meets all
        ok(ttft=0.6, tpot=0.02, tokens=5),  # TTFT too slow
        ok(ttft=0.1, tpot=0.08, tokens=5),  # TPOT too slow
        ok(ttft=0.3, tpot=0.01, tokens=1),  # one token: no TPOT, meets the rest
        failed(ErrorKind.TIMEOUT),  # failures never count
    )
    slo = GoodputSLO.parse(["ttft:500", "tpot:50"])
    metrics = compute_metrics(result(*records, duration=4.0), slo)
    assert metrics.request_goodput == pytest.approx(2 / 4.0)
    assert metrics.request_throughput == pytest.approx(4 / 4.0)
    e2e_only = compute_metrics(result(*records, duration=4.0), GoodputSLO(e2el_ms=200))
    assert e2e_only.request_goodput == pytest.approx(1 / 4.0)  # only the first ends within 200 ms


def test_goodput_boundary_is_inclusive() -> None:
    assert GoodputSLO(ttft_ms=100).is_met(ok(ttft=0.1, tpot=0.0, tokens=2))


@pytest.mark.parametrize("specs", [["ttft"], ["ttft:abc"], ["foo:10"], ["ttft:0"], ["ttft:1", "ttft:2"], []])
def test_bad_goodput_specs_are_rejected(specs: list[str]) -> None:
    with pytest.raises(GoodputError):
        GoodputSLO.parse(specs)


def test_throughputs_and_percentiles_are_exact() -> None:
    records = [ok(ttft=i / 1000, tpot=0.01, tokens=3, prompt=5) for i in range(1, 101)]
    records.append(failed(ErrorKind.HTTP_STATUS, 500))
    metrics = compute_metrics(result(*records, duration=5.0), percentiles=(90, 99, 99.9))
    assert (metrics.completed, metrics.failed, metrics.errors_by_type) == (100, 1, {"http_500": 1})
    assert metrics.total_input_tokens == 500 and metrics.total_output_tokens == 300
    assert metrics.request_throughput == 20.0 and metrics.output_throughput == 60.0
    assert metrics.total_token_throughput == 160.0
    ttft = metrics.latencies["ttft"]
    expected = np.arange(1, 101, dtype=float)
    assert ttft.mean_ms == pytest.approx(50.5) and ttft.median_ms == pytest.approx(50.5)
    assert ttft.std_ms == pytest.approx(expected.std())
    assert ttft.percentiles_ms[99] == pytest.approx(np.percentile(expected, 99))
    assert metrics.latencies["tpot"].mean_ms == pytest.approx(10.0)
    assert metrics.latencies["itl"].count == 200
    assert metrics.to_dict()["p99_9_ttft_ms"] == pytest.approx(np.percentile(expected, 99.9))


def test_json_has_vllm_keys_and_nulls_for_undefined_latencies(tmp_path) -> None:
    metrics = compute_metrics(result(failed(ErrorKind.CONNECT)), GoodputSLO(ttft_ms=1))
    data = json.loads(save_result({"request_rate": float("inf"), **metrics.to_dict()}, tmp_path / "r.json").read_text())
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "request_goodput", "goodput", "duration"):
        assert key in data
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in data and data[f"{stat}_{name}_ms"] is None
    assert data["request_rate"] == "inf" and data["errors_by_type"] == {"connect": 1}
    assert data["goodput"] == 0.0


def test_table_shows_the_headline_numbers() -> None:
    metrics = compute_metrics(result(ok(0.1, 0.01, 3), failed(ErrorKind.DISCONNECT)), GoodputSLO(ttft_ms=500))
    table = format_table(metrics)
    for text in ("Successful requests", "disconnect", "Request goodput", "Median TTFT (ms)", "P99 ITL (ms)"):
        assert text in table
    assert "100.00" in table  # the TTFT
