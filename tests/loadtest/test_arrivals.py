"""The arrival generator, tested statistically on seeded draws (no sleeping)."""

import asyncio
import math
import time

import numpy as np
import pytest

from kvserve.loadtest.arrivals import ArrivalProcess, paced


def test_poisson_gaps_have_the_requested_rate_and_exponential_shape() -> None:
    rate = 8.0
    gaps = ArrivalProcess(request_rate=rate).gaps(40_000, np.random.default_rng(0))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Exponential: coefficient of variation 1, and P(gap > mean) = 1/e.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    assert np.mean(gaps > 1 / rate) == pytest.approx(math.exp(-1), abs=0.01)


def test_poisson_counts_per_second_have_poisson_mean_and_variance() -> None:
    rate = 5.0
    offsets = ArrivalProcess(request_rate=rate).offsets(50_000, seed=1)
    counts = np.bincount(offsets.astype(int))[:-1]  # drop the last, partial second
    assert counts.mean() == pytest.approx(rate, rel=0.03)
    assert counts.var() == pytest.approx(rate, rel=0.08)  # Poisson: variance == mean


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_gamma_burstiness_keeps_the_mean_and_sets_the_spread(burstiness: float) -> None:
    rate = 3.0
    gaps = ArrivalProcess(request_rate=rate, burstiness=burstiness).gaps(40_000, np.random.default_rng(2))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.04)
    # Gamma with shape k: CV^2 = 1/k. Bursty (<1) spreads gaps, >1 evens them out.
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.08)


def test_offsets_are_seeded_start_at_zero_and_increase() -> None:
    process = ArrivalProcess(request_rate=2.0)
    a, b = process.offsets(100, seed=7), process.offsets(100, seed=7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, process.offsets(100, seed=8))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert np.array_equal(ArrivalProcess().offsets(5, seed=0), np.zeros(5))


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, math.inf)])
def test_invalid_processes_are_rejected(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError, match="--"):
        ArrivalProcess(request_rate=rate, burstiness=burstiness)


def test_paced_yields_in_order_and_not_before_each_offset() -> None:
    offsets = np.array([0.0, 0.05, 0.1])

    async def collect() -> list[tuple[str, float]]:
        start = time.perf_counter()
        return [(item, time.perf_counter() - start) async for item in paced(["a", "b", "c"], offsets, start)]

    seen = asyncio.run(collect())
    assert [item for item, _ in seen] == ["a", "b", "c"]
    assert all(at >= offset for (_, at), offset in zip(seen, offsets))
