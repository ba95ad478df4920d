"""Present a run: a fixed-width table for the terminal and a JSON file for later comparison."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from .metrics import LATENCY_METRICS, BenchmarkMetrics

_WIDTH = 56
_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _row(label: str, value: object) -> str:
    return f"{label + ':':<40}{value!s:>{_WIDTH - 40}}"


def format_table(metrics: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    lines = [f" {title} ".center(_WIDTH, "="), _row("Successful requests", metrics.completed)]
    lines.append(_row("Failed requests", metrics.failed))
    for error_type, count in metrics.errors_by_type.items():
        lines.append(_row(f"  {error_type}", count))
    if metrics.cancelled or metrics.not_sent or metrics.hit_duration_cap:
        lines.append(_row("Cancelled at --duration cap", metrics.cancelled))
        lines.append(_row("Not sent (cap reached first)", metrics.not_sent))
    if metrics.usage_mismatches:
        lines.append(_row("Usage != streamed chunks (requests)", metrics.usage_mismatches))
    lines += [
        _row("Benchmark duration (s)", _fmt(metrics.duration_s)),
        _row("Total input tokens", metrics.total_input_tokens),
        _row("Total generated tokens", metrics.total_output_tokens),
        _row("Request throughput (req/s)", _fmt(metrics.request_throughput)),
    ]
    if metrics.request_goodput is not None:
        lines.append(_row("Request goodput (req/s)", _fmt(metrics.request_goodput)))
    lines += [
        _row("Output token throughput (tok/s)", _fmt(metrics.output_throughput)),
        _row("Total token throughput (tok/s)", _fmt(metrics.total_token_throughput)),
    ]
    for name in LATENCY_METRICS:
        stats = metrics.latencies[name]
        lines.append(f" {_TITLES[name]} ".center(_WIDTH, "-"))
        lines.append(_row(f"Mean {name.upper()} (ms)", _fmt(stats.mean_ms)))
        lines.append(_row(f"Median {name.upper()} (ms)", _fmt(stats.median_ms)))
        for p, value in stats.percentiles_ms.items():
            lines.append(_row(f"P{p:g} {name.upper()} (ms)", _fmt(value)))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    # JSON has no inf/NaN: an "inf" request rate is written as the string "inf".
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def default_result_filename(label: str, model: str, now: datetime | None = None) -> str:
    """`<label>-<model>-<YYYYmmdd-HHMMSS>.json`, the model reduced to a safe basename.

    The label says what ran, e.g. "bench-4qps" or "sweep".
    """
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    safe_model = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/").rsplit("/", 1)[-1]) or "model"
    return f"{label}-{safe_model}-{stamp}.json"


def save_result(result: Mapping[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(result), indent=2) + "\n", encoding="utf-8")
    return path
