"""Service-level objectives for goodput: the rate of requests that met every objective.

Throughput counts requests a server finished; goodput counts those a user would call fast enough
(DistServe, OSDI'24). Objectives are given as `--goodput ttft:MS tpot:MS e2el:MS`, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .records import RequestRecord

_KEYS = ("ttft", "tpot", "e2el")


class GoodputError(ValueError):
    """A --goodput objective is malformed; the message shows the expected form."""


@dataclass(frozen=True)
class GoodputSLO:
    """Upper bounds in milliseconds; None leaves that latency unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for key, value in self._items():
            if value is not None and not value > 0:
                raise GoodputError(f"--goodput {key} must be > 0 ms, got {value}")
        if self.is_empty:
            raise GoodputError("--goodput needs at least one of ttft:MS, tpot:MS, e2el:MS")

    @property
    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    @classmethod
    def parse(cls, specs: Sequence[str]) -> GoodputSLO:
        """`["ttft:500", "tpot:50"]` -> GoodputSLO(ttft_ms=500, tpot_ms=50)."""
        values: dict[str, float] = {}
        for spec in specs:
            key, sep, number = spec.partition(":")
            key = key.strip().lower()
            if not sep or key not in _KEYS:
                raise GoodputError(f"--goodput expects KEY:MS with KEY in {', '.join(_KEYS)}; got {spec!r}")
            if key in values:
                raise GoodputError(f"--goodput gives {key} twice")
            try:
                values[key] = float(number)
            except ValueError as e:
                raise GoodputError(f"--goodput {key}: {number!r} is not a number of milliseconds") from e
        return cls(ttft_ms=values.get("ttft"), tpot_ms=values.get("tpot"), e2el_ms=values.get("e2el"))

    def is_met(self, record: RequestRecord) -> bool:
        """Whether a request met every objective. Failed requests never do.

        A one-token answer has no time per output token, so it cannot miss a TPOT objective.
        """
        if not record.success or record.ttft_s is None or record.e2e_s is None:
            return False
        if self.ttft_ms is not None and record.ttft_s * 1e3 > self.ttft_ms:
            return False
        tpot = record.tpot_s
        if self.tpot_ms is not None and tpot is not None and tpot * 1e3 > self.tpot_ms:
            return False
        if self.e2el_ms is not None and record.e2e_s * 1e3 > self.e2el_ms:
            return False
        return True

    def _items(self) -> tuple[tuple[str, float | None], ...]:
        return (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))

    def to_dict(self) -> dict[str, float]:
        return {key: value for key, value in self._items() if value is not None}
