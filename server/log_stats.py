"""The periodic "what is the engine doing" log line, and the warning that explains preemptions.

`LogStats` is an engine `StatsListener` (see engine/stats.py). It sums the per-step records and,
while the engine is busy, logs one line every `interval_s` seconds:

    Engine: 4 running, 2 waiting, KV cache 87.5% used, prompt 1520.3 tok/s, generation 118.0 tok/s,
    prefix cache hit rate 42.1%, 3 finished, 1 preempted

Nothing is logged while idle (the engine sends no steps then), so an idle server's log stays quiet.
A burst shorter than the interval still gets its line: when a step leaves nothing running or
waiting, or when the first step after an idle gap arrives, the unlogged window is written out with
rates over its own span (never diluted by the idle time).
Preemptions get a separate warning, rate-limited to one per interval, because they mean the KV
cache is too small for the load and the operator can act on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.engine import FinishedRequestStats, StepStats

DEFAULT_LOGGER_NAME = "kvserve.stats"


@dataclass
class _Window:
    """Sums over the steps since the last log line."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preempted: int = 0
    finished: int = 0


class LogStats:
    """Logs the periodic engine line while busy and warns when requests are preempted.

    `clock` returns seconds (monotonic); tests inject a fake one so no test sleeps.
    """

    def __init__(
        self,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"the stats log interval must be positive seconds, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._logger = logger if logger is not None else logging.getLogger(DEFAULT_LOGGER_NAME)
        # The engine calls from one thread, but a lock keeps a second caller (tests, an async
        # wrapper) from tearing the window sums; it is uncontended in production.
        self._lock = threading.Lock()
        self._window = _Window()
        self._window_start: float | None = None  # set by the first step of a busy period
        self._window_has_data = False
        self._last_step: tuple[float, StepStats] | None = None
        self._last_warning: float | None = None
        self._preempted_since_warning = 0

    def on_step(self, stats: StepStats) -> None:
        with self._lock:
            now = self._clock()
            # Idle time is the gap between the previous step's end and this step's start: a step
            # longer than the interval (a big prefill on a slow CPU) is busy time, not idleness.
            if self._last_step is not None and now - stats.duration_s - self._last_step[0] > self.interval_s:
                # The engine was idle: close the previous burst at its own last step.
                last_time, last_stats = self._last_step
                self._flush(last_stats, last_time)
                self._window_start = None  # the new burst starts with this step
            if self._window_start is None:
                self._window_start = now - stats.duration_s
            window = self._window
            window.prompt_tokens += stats.num_prompt_tokens
            window.generation_tokens += stats.num_generation_tokens
            window.prefix_queries += stats.prefix_cache_queries
            window.prefix_hits += stats.prefix_cache_hits
            window.preempted += stats.num_preempted
            self._window_has_data = True
            self._last_step = (now, stats)
            if stats.num_preempted:
                self._preempted_since_warning += stats.num_preempted
                self._maybe_warn_preemption(stats, now)
            if self._is_idle(stats) or now - self._window_start >= self.interval_s:
                self._flush(stats, now)

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        with self._lock:
            self._window.finished += 1

    def _flush(self, stats: StepStats, now: float) -> None:
        """Log the window ending at `now` (if it saw any step) and start an empty one."""
        if self._window_has_data and self._window_start is not None:
            self._log_line(stats, now - self._window_start)
        self._window = _Window()
        self._window_start = None if self._is_idle(stats) else now
        self._window_has_data = False

    @staticmethod
    def _is_idle(stats: StepStats) -> bool:
        return stats.num_running == 0 and stats.num_waiting == 0

    def _log_line(self, stats: StepStats, elapsed: float) -> None:
        window = self._window

        def per_second(count: int) -> float:
            return count / elapsed if elapsed > 0 else 0.0

        hit_rate = window.prefix_hits / window.prefix_queries if window.prefix_queries else 0.0
        self._logger.info(
            "Engine: %d running, %d waiting, KV cache %.1f%% used, prompt %.1f tok/s, "
            "generation %.1f tok/s, prefix cache hit rate %.1f%%, %d finished, %d preempted",
            stats.num_running,
            stats.num_waiting,
            100.0 * stats.kv_usage,
            per_second(window.prompt_tokens),
            per_second(window.generation_tokens),
            100.0 * hit_rate,
            window.finished,
            window.preempted,
        )

    def _maybe_warn_preemption(self, stats: StepStats, now: float) -> None:
        if self._last_warning is not None and now - self._last_warning < self.interval_s:
            return
        self._logger.warning(
            "%d request(s) preempted: the KV cache is full (%d of %d blocks used) and their KV will "
            "be recomputed, which costs throughput. Give the cache more blocks with --num-kv-blocks "
            "or --kv-cache-memory, or run fewer requests at once with a lower --max-num-seqs.",
            self._preempted_since_warning,
            stats.kv_blocks_used,
            stats.kv_blocks_total,
        )
        self._last_warning = now
        self._preempted_since_warning = 0
