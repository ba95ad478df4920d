"""Reduce a run's request records to the numbers users compare servers by.

Key names follow `vllm bench serve` so results from either tool can sit in one table:
`completed`, `total_output_tokens`, `request_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...
Latency statistics cover successful requests only; ITL pools every gap of every request.
An undefined statistic (no successful request) is None, written as JSON null, never a fake 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .goodput import GoodputSLO
from .records import RequestRecord, RunResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency in milliseconds; every field is None when there were no samples."""

    count: int
    mean_ms: float | None
    median_ms: float | None
    std_ms: float | None
    percentiles_ms: dict[float, float | None] = field(default_factory=dict)

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        if not seconds:
            return cls(0, None, None, None, {p: None for p in percentiles})
        ms = np.asarray(seconds, dtype=float) * 1e3
        return cls(
            count=len(ms),
            mean_ms=float(ms.mean()),
            median_ms=float(np.median(ms)),
            std_ms=float(ms.std()),
            percentiles_ms={p: float(np.percentile(ms, p)) for p in percentiles},
        )


def _percentile_label(p: float) -> str:
    return f"p{p:g}".replace(".", "_")  # 99.9 -> p99_9, as vLLM writes it


@dataclass(frozen=True)
class BenchmarkMetrics:
    duration_s: float
    completed: int
    failed: int
    cancelled: int
    not_sent: int
    errors_by_type: dict[str, int]
    usage_mismatches: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None  # None when no --goodput objectives were given
    goodput_slo: GoodputSLO | None
    latencies: dict[str, LatencyStats]
    hit_duration_cap: bool

    def to_dict(self) -> dict[str, Any]:
        """The flat, vLLM-compatible JSON result."""
        out: dict[str, Any] = {
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "not_sent": self.not_sent,
            "hit_duration_cap": self.hit_duration_cap,
            "errors_by_type": dict(self.errors_by_type),
            "usage_mismatches": self.usage_mismatches,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            # vLLM writes "request_goodput"; "goodput" is the same number under the short name.
            "goodput": self.request_goodput,
            "goodput_slo_ms": self.goodput_slo.to_dict() if self.goodput_slo else None,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in LATENCY_METRICS:
            stats = self.latencies[name]
            out[f"mean_{name}_ms"] = stats.mean_ms
            out[f"median_{name}_ms"] = stats.median_ms
            out[f"std_{name}_ms"] = stats.std_ms
            for p, value in stats.percentiles_ms.items():
                out[f"{_percentile_label(p)}_{name}_ms"] = value
        return out


def compute_metrics(
    run: RunResult,
    goodput_slo: GoodputSLO | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchmarkMetrics:
    if any(not 0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must lie in (0, 100], got {list(percentiles)}")
    ok: list[RequestRecord] = [r for r in run.records if r.success]
    failed = [r for r in run.records if not r.success]
    duration = run.duration_s
    if not duration > 0:
        raise ValueError(f"a run's duration must be > 0 s, got {duration}")
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [t for r in ok if (t := r.tpot_s) is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2e_s for r in ok if r.e2e_s is not None],
    }
    good = sum(goodput_slo.is_met(r) for r in ok) if goodput_slo else None
    return BenchmarkMetrics(
        duration_s=duration,
        completed=len(ok),
        failed=len(failed),
        cancelled=run.cancelled,
        not_sent=run.not_sent,
        errors_by_type=dict(sorted(Counter(r.error_type for r in failed).items())),
        usage_mismatches=sum(r.usage_mismatch for r in ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        request_goodput=good / duration if good is not None else None,
        goodput_slo=goodput_slo,
        latencies={name: LatencyStats.of(values, percentiles) for name, values in samples.items()},
        hit_duration_cap=run.hit_duration_cap,
    )
