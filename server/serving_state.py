"""The server's lifecycle and admission control.

    LOADING --attach_engine--> READY --begin_drain (SIGTERM)--> DRAINING
       503 on /v1, /health       200         503 + Retry-After for new work; in-flight continues

Admission counts sequences (prompts x n) in flight through this server. The engine runs at most
`max_num_seqs` of them at once; `max_queued_requests` more may wait. Beyond that a request gets
503 + Retry-After right away: a client (or load balancer) retrying elsewhere beats a queue whose
latency grows without bound. The count is kept here, synchronously, rather than read from the
engine, so that two requests admitted in the same event-loop tick cannot both squeeze past.
"""

from __future__ import annotations

import asyncio
import enum
import logging

from kvserve.server.engine_protocol import ServingEngine
from kvserve.server.errors import bad_request, unavailable
from kvserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)


class Phase(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


class Admission:
    """One admitted request's share of the capacity; `release` is idempotent so every exit path
    (finished, failed, client gone) can call it."""

    def __init__(self, state: "ServingState", num_sequences: int) -> None:
        self._state = state
        self.num_sequences = num_sequences
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._state._on_release(self)


class ServingState:
    def __init__(self, settings: ServerSettings, engine: ServingEngine | None = None) -> None:
        self.settings = settings
        self.phase = Phase.LOADING
        self._engine: ServingEngine | None = None
        self.in_flight_sequences = 0
        self.in_flight_requests = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Set when the drain grace period ends: running generations stop with finish_reason "abort".
        self.abort_all = asyncio.Event()
        if engine is not None:
            self.attach_engine(engine)

    def attach_engine(self, engine: ServingEngine) -> None:
        self._engine = engine
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY

    @property
    def engine(self) -> ServingEngine | None:
        return self._engine

    def ready_engine(self) -> ServingEngine:
        """The engine, if this server may take new work now; otherwise a 503 to raise."""
        retry = self.settings.retry_after_s
        if self.phase is Phase.LOADING or self._engine is None:
            raise unavailable("The model is still loading; retry shortly.", retry)
        if self.phase is Phase.DRAINING:
            raise unavailable("The server is shutting down and accepts no new requests; "
                              "retry on another replica.", retry)
        if self._engine.is_dead:
            raise unavailable(f"The inference engine has failed ({self._engine.dead_error}); "
                              "the server must be restarted.", None)
        return self._engine

    @property
    def capacity(self) -> int:
        engine = self.ready_engine()
        return engine.config.max_num_seqs + self.settings.max_queued_requests

    def admit(self, num_sequences: int) -> Admission:
        capacity = self.capacity
        if num_sequences > capacity:
            raise bad_request(f"This request asks for {num_sequences} sequences (prompts x n) but the server "
                              f"admits at most {capacity} at once; split it into smaller requests.", "n")
        if self.in_flight_sequences + num_sequences > capacity:
            raise unavailable(f"The server is at capacity ({self.in_flight_sequences} sequences in flight, "
                              f"limit {capacity}); retry shortly.", self.settings.retry_after_s)
        self.in_flight_sequences += num_sequences
        self.in_flight_requests += 1
        self._idle.clear()
        return Admission(self, num_sequences)

    def _on_release(self, admission: Admission) -> None:
        self.in_flight_sequences -= admission.num_sequences
        self.in_flight_requests -= 1
        if self.in_flight_requests == 0:
            self._idle.set()

    async def drain(self, grace_period_s: float, abort_timeout_s: float = 5.0) -> bool:
        """Stops admitting, waits up to `grace_period_s` for in-flight requests, then aborts the
        rest (they end with finish_reason "abort") and waits up to `abort_timeout_s` for their
        responses to go out. Returns True when every request finished on its own."""
        self.phase = Phase.DRAINING
        logger.info("draining: %d requests in flight, grace period %.1f s", self.in_flight_requests, grace_period_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_period_s)
            return True
        except asyncio.TimeoutError:
            logger.warning("grace period over: aborting %d requests", self.in_flight_requests)
        self.abort_all.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=abort_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("%d responses still open after abort; closing anyway", self.in_flight_requests)
        return False
