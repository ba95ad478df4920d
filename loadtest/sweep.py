"""A request-rate sweep: the same workload at several rates, one point of the latency/throughput curve each."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .arrivals import ArrivalProcess
from .client import Endpoint
from .datasets import BenchRequest
from .goodput import GoodputSLO
from .metrics import DEFAULT_PERCENTILES, BenchmarkMetrics, compute_metrics
from .runner import LoadConfig, run_load


@dataclass(frozen=True)
class SweepPoint:
    request_rate: float
    metrics: BenchmarkMetrics
    ttfts_s: tuple[float, ...]  # every successful request's TTFT, for the CDF plot


def parse_rates(text: str) -> tuple[float, ...]:
    """`"1,2,4,inf"` -> (1.0, 2.0, 4.0, inf); rates must be > 0 and are kept in the given order."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError as e:
            raise ValueError(f"--request-rate-sweep: {part!r} is not a number (use e.g. '1,2,4,inf')") from e
        if not rate > 0:
            raise ValueError(f"--request-rate-sweep: rates must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rate-sweep needs at least one rate")
    return tuple(rates)


async def run_sweep(
    endpoint: Endpoint,
    requests: Sequence[BenchRequest],
    load: LoadConfig,
    rates: Sequence[float],
    goodput_slo: GoodputSLO | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> list[SweepPoint]:
    """Run the workload once per rate; the server is warmed up before the first rate only."""
    points = []
    for index, rate in enumerate(rates):
        arrivals = ArrivalProcess(request_rate=rate, burstiness=load.arrivals.burstiness)
        load_at_rate = dataclasses.replace(load, arrivals=arrivals, num_warmups=load.num_warmups if index == 0 else 0)
        run = await run_load(endpoint, requests, load_at_rate)
        metrics = compute_metrics(run, goodput_slo, percentiles)
        ttfts = tuple(r.ttft_s for r in run.records if r.success and r.ttft_s is not None)
        points.append(SweepPoint(request_rate=rate, metrics=metrics, ttfts_s=ttfts))
    return points


def rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"
