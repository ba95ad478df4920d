"""When each request is sent: all at once, Poisson, or gamma-distributed (bursty) arrivals.

Inter-arrival gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): the mean gap is always
1/rate, burstiness 1 is a Poisson process, < 1 clumps requests into bursts, > 1 spaces them evenly
(the same model as `vllm bench serve`). The schedule is computed up front as absolute offsets from
the start, so a late wake-up never shifts the requests after it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(frozen=True)
class ArrivalProcess:
    request_rate: float = math.inf  # requests per second; inf sends everything at once
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:  # also rejects NaN
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness must be a finite number > 0, got {self.burstiness}")

    def gaps(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """`count` inter-arrival gaps in seconds (the first request waits gaps[0] too)."""
        if math.isinf(self.request_rate):
            return np.zeros(count)
        scale = 1.0 / (self.request_rate * self.burstiness)
        return rng.gamma(shape=self.burstiness, scale=scale, size=count)

    def offsets(self, count: int, seed: int) -> np.ndarray:
        """Send times in seconds after the start; seeded, so a run is reproducible.

        The first request goes at 0 so that a run never begins with an idle wait.
        """
        gaps = self.gaps(count, np.random.default_rng(seed))
        if count:
            gaps[0] = 0.0
        return np.cumsum(gaps)


async def paced(items: Sequence[T], offsets: np.ndarray, start: float) -> AsyncIterator[T]:
    """Yield each item once `time.perf_counter()` reaches `start + offset`."""
    for item, offset in zip(items, offsets):
        delay = start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield item
