"""LogStats: the periodic line while busy, silence while idle, and the preemption warning."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest

from kvserve.engine.stats import FinishedRequestStats, StepStats
from kvserve.server.log_stats import LogStats
from tests.server.metrics_workload import build_known_workload, feed

LOGGER = "kvserve.test.stats"


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def busy_step(**changes: int) -> StepStats:
    base = StepStats(
        timestamp=0.0,
        duration_s=0.0,
        num_scheduled_tokens=110,
        num_prompt_tokens=100,
        num_generation_tokens=10,
        num_running=4,
        num_waiting=2,
        num_preempted=0,
        kv_blocks_total=200,
        kv_blocks_used=50,
        kv_blocks_cached=30,
        kv_blocks_free=120,
        prefix_cache_queries=200,
        prefix_cache_hits=50,
    )
    return replace(base, **changes)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def stats_log(clock: FakeClock) -> LogStats:
    return LogStats(interval_s=5.0, clock=clock, logger=logging.getLogger(LOGGER))


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_one_line_per_interval_with_rates_over_the_window(stats_log: LogStats, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(10):  # one step a second: 10 s of work
        clock.now += 1.0
        stats_log.on_step(busy_step())
    info = lines(caplog, logging.INFO)
    # the window opens at the first step (t=101) and closes at t=106, then t=111 would be next
    assert len(info) == 1
    assert info[0] == (
        "Engine: 4 running, 2 waiting, KV cache 25.0% used, prompt 120.0 tok/s, "
        "generation 12.0 tok/s, prefix cache hit rate 25.0%, 0 finished, 0 preempted"
    )
    clock.now += 1.0
    stats_log.on_step(busy_step())
    assert len(lines(caplog, logging.INFO)) == 2


def test_nothing_is_logged_while_idle(stats_log: LogStats, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock.now += 3600.0  # an hour with no steps
    assert lines(caplog, logging.INFO) == []
    clock.now += 1.0
    stats_log.on_step(busy_step())
    assert lines(caplog, logging.INFO) == []  # a fresh window, not one diluted by the idle hour


def test_a_short_burst_is_logged_when_the_engine_goes_idle(stats_log: LogStats, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock.now += 1.0
    stats_log.on_step(busy_step(duration_s=1.0))
    stats_log.on_request_finished(FinishedRequestStats("stop", 0.0, 0.0, 0.5, 1.0, 1.0, 100, 0, 10, ()))
    clock.now += 1.0
    stats_log.on_step(busy_step(duration_s=1.0, num_running=0, num_waiting=0, num_prompt_tokens=0, num_generation_tokens=2))
    info = lines(caplog, logging.INFO)
    assert len(info) == 1
    # 2 s window (from the start of the first step): 100 prompt and 12 generated tokens
    assert "0 running, 0 waiting" in info[0]
    assert "prompt 50.0 tok/s, generation 6.0 tok/s" in info[0]
    assert "1 finished" in info[0]


def test_a_burst_cut_short_by_an_idle_gap_is_logged_over_its_own_span(stats_log: LogStats, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock.now += 1.0
    stats_log.on_step(busy_step(duration_s=1.0))
    clock.now += 1.0
    stats_log.on_step(busy_step(duration_s=1.0))  # engine then sits idle, still reporting 4 running
    clock.now += 600.0
    stats_log.on_step(busy_step(duration_s=1.0))
    info = lines(caplog, logging.INFO)
    assert len(info) == 1
    assert "prompt 100.0 tok/s, generation 10.0 tok/s" in info[0]  # 200 + 20 tokens over 2 s


def test_steps_longer_than_the_interval_are_busy_time_not_idle_gaps(stats_log: LogStats, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    for duration in (1.0, 6.0, 6.0):  # back to back: busy all along (a slow CPU prefill)
        clock.now += duration
        stats_log.on_step(busy_step(duration_s=duration))
    info = lines(caplog, logging.INFO)
    assert len(info) == 2  # one per interval crossed, no line split off by a mistaken idle gap
    assert "prompt 28.6 tok/s" in info[0]  # 200 tokens over the first 7 s
    assert "prompt 16.7 tok/s" in info[1]  # 100 tokens over the next 6 s


def test_preemption_warning_names_the_settings_and_is_rate_limited(stats_log: LogStats, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock.now += 1.0
    stats_log.on_step(busy_step(num_preempted=2, kv_blocks_used=200, kv_blocks_free=0, kv_blocks_cached=0))
    warnings = lines(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert warnings[0].startswith("2 request(s) preempted")
    assert "200 of 200 blocks used" in warnings[0]
    for setting in ("--num-kv-blocks", "--kv-cache-memory", "--max-num-seqs"):
        assert setting in warnings[0]
    clock.now += 1.0
    stats_log.on_step(busy_step(num_preempted=3))  # within the interval: counted, not warned
    assert len(lines(caplog, logging.WARNING)) == 1
    clock.now += 5.0
    stats_log.on_step(busy_step(num_preempted=1))
    warnings = lines(caplog, logging.WARNING)
    assert len(warnings) == 2
    assert warnings[1].startswith("4 request(s) preempted")  # the 3 held back plus this 1


def test_periodic_line_counts_preemptions_since_the_last_line(stats_log: LogStats, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    for preempted in (1, 0, 2, 0, 0, 0):
        clock.now += 1.0
        stats_log.on_step(busy_step(num_preempted=preempted))
    assert lines(caplog, logging.INFO)[0].endswith("3 preempted")
    for _ in range(5):
        clock.now += 1.0
        stats_log.on_step(busy_step())
    assert lines(caplog, logging.INFO)[1].endswith("0 preempted")


def test_known_workload_logs_its_totals(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    stats_log = LogStats(interval_s=3600.0, clock=clock, logger=logging.getLogger(LOGGER))
    workload = build_known_workload()
    feed(stats_log, workload)
    info = lines(caplog, logging.INFO)
    assert len(info) == 1  # one line when the workload drains, none before (1 h interval)
    finished, preempted = re.search(r"(\d+) finished, (\d+) preempted$", info[0]).groups()  # type: ignore[union-attr]
    assert (int(finished), int(preempted)) == (10, 1)


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval"):
        LogStats(interval_s=0)
