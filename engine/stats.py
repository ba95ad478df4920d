"""Plain records the engine emits for metrics and logs, and the listener protocol that takes them.

The engine calls listeners from its own thread after each step; a listener must be quick and must
not raise (the metrics exporter and the periodic log line are the two in-tree listeners).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.scheduler.request import FinishReason


@dataclass(frozen=True)
class StepStats:
    """One engine step."""

    timestamp: float  # time.monotonic() at the end of the step
    duration_s: float  # schedule + model + update
    num_scheduled_tokens: int
    num_prompt_tokens: int  # prompt tokens computed this step (prefill chunks)
    num_generation_tokens: int  # tokens sampled this step
    num_running: int
    num_waiting: int
    num_preempted: int  # requests preempted in this step
    kv_blocks_total: int
    kv_blocks_used: int  # referenced by at least one request
    kv_blocks_cached: int  # free, but holding a reusable prefix-cache entry
    kv_blocks_free: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int  # of those, tokens found
    # Speculative decoding: requests that verified drafts, drafted tokens, how many were kept;
    # spec_accepted_per_position[i] counts the requests whose draft i was kept.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds right now: the gauges' source of truth. Taken on the engine thread
    between steps (so it is consistent) and read by the metrics endpoint at scrape time, so the
    gauges stay true when requests leave without a step (aborts, disconnects, timeouts)."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_free: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished completion (each of n > 1 completions counts as one)."""

    finish_reason: FinishReason
    arrival_time: float
    first_scheduled_time: float | None  # None when aborted before it ran
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    inter_token_latencies: tuple[float, ...]  # gaps between consecutive generated tokens


class StatsListener(Protocol):
    def on_step(self, stats: StepStats) -> None: ...

    def on_request_finished(self, stats: FinishedRequestStats) -> None: ...
