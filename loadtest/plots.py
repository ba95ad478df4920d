"""PNG plots of a rate sweep. matplotlib is imported only here, and only when plotting.

Figures are built with matplotlib's object API (Figure + Agg canvas), not pyplot, so plotting
touches no global state and needs no display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .sweep import SweepPoint, rate_label


def _ms(value: float | None) -> float:
    # A rate where nothing succeeded has no latency: a gap in the line, not a point at 0.
    return float("nan") if value is None else value


def _figure(width: float, height: float):  # -> matplotlib.figure.Figure
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("sweep plots need matplotlib: pip install 'kvserve[bench]' (or matplotlib)") from e
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_latency_vs_throughput(points: Sequence[SweepPoint], path: Path) -> Path:
    """Median and P99 of TTFT, TPOT and e2e latency against achieved output tokens/s."""
    figure = _figure(13, 4)
    throughput = [p.metrics.output_throughput for p in points]
    for axes, name, title in zip(
        figure.subplots(1, 3), ("ttft", "tpot", "e2el"), ("TTFT", "TPOT", "End-to-end latency")
    ):
        stats = [p.metrics.latencies[name] for p in points]
        p99_key = max(stats[0].percentiles_ms, default=None)
        axes.plot(throughput, [_ms(s.median_ms) for s in stats], "o-", label="median")
        if p99_key is not None:
            axes.plot(throughput, [_ms(s.percentiles_ms[p99_key]) for s in stats], "s--", label=f"p{p99_key:g}")
        for x, s, point in zip(throughput, stats, points):
            if s.median_ms is not None:
                axes.annotate(rate_label(point.request_rate), (x, s.median_ms), fontsize=7,
                              textcoords="offset points", xytext=(3, 3))
        axes.set_xlabel("output throughput (tokens/s)")
        axes.set_ylabel(f"{title} (ms)")
        axes.set_title(f"{title} vs throughput")
        axes.grid(alpha=0.3)
        axes.legend()
    figure.savefig(path, dpi=110)
    return path


def plot_ttft_cdf(points: Sequence[SweepPoint], path: Path) -> Path:
    """Empirical CDF of TTFT, one curve per request rate."""
    figure = _figure(6.5, 4.5)
    axes = figure.subplots()
    for point in points:
        if not point.ttfts_s:
            continue
        ms = np.sort(np.asarray(point.ttfts_s)) * 1e3
        axes.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=rate_label(point.request_rate))
    axes.set_xlabel("TTFT (ms)")
    axes.set_ylabel("fraction of requests")
    axes.set_title("TTFT CDF by request rate")
    axes.set_ylim(0, 1.02)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=110)
    return path


def plot_sweep(points: Sequence[SweepPoint], out_dir: Path, stem: str = "sweep") -> list[Path]:
    """Write `<stem>-latency_vs_throughput.png` and `<stem>-ttft_cdf.png` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_latency_vs_throughput(points, out_dir / f"{stem}-latency_vs_throughput.png"),
        plot_ttft_cdf(points, out_dir / f"{stem}-ttft_cdf.png"),
    ]
