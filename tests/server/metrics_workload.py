"""A known synthetic workload, fed to stats listeners as the engine would feed it.

Ten requests run one after another (one running request per step, which keeps the arithmetic
checkable by hand), each as: a prefill step that computes its uncached prompt tokens and samples
its first token, then one decode step per further token. Request 6 is preempted after 4 tokens and
recomputes its 70 prompt + 4 generated tokens in one step before decoding on. Request 8 is aborted
after 2 tokens; request 9 is aborted while still waiting.

The expected totals are spelled out as literals in the tests rather than recomputed, so a mistake
in this builder cannot cancel a mistake in the code under test.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.stats import FinishedRequestStats, StatsListener, StepStats

STEP_S = 0.025  # every step takes this long
ARRIVAL_GAP_S = 0.1
KV_BLOCKS_TOTAL = 64


@dataclass(frozen=True)
class RequestSpec:
    prompt: int
    cached: int
    output: int
    reason: str
    preempt_after: int | None = None  # generated tokens before it is preempted
    ran: bool = True


SPECS = (
    RequestSpec(10, 0, 3, "stop"),
    RequestSpec(20, 16, 4, "stop"),
    RequestSpec(30, 16, 5, "stop"),
    RequestSpec(40, 32, 6, "stop"),
    RequestSpec(50, 0, 7, "length"),
    RequestSpec(60, 48, 8, "length"),
    RequestSpec(70, 0, 9, "length", preempt_after=4),
    RequestSpec(80, 64, 10, "length"),
    RequestSpec(90, 0, 2, "abort"),
    RequestSpec(100, 0, 0, "abort", ran=False),
)


@dataclass
class Workload:
    steps: list[StepStats]
    finished: list[FinishedRequestStats]


def _step(now: float, scheduled: int, prompt: int, generated: int, running: int, waiting: int,
          preempted: int = 0, queries: int = 0, hits: int = 0) -> StepStats:  # fmt: skip
    used = min(KV_BLOCKS_TOTAL, running * 8)
    cached = 10
    return StepStats(
        timestamp=now,
        duration_s=STEP_S,
        num_scheduled_tokens=scheduled,
        num_prompt_tokens=prompt,
        num_generation_tokens=generated,
        num_running=running,
        num_waiting=waiting,
        num_preempted=preempted,
        kv_blocks_total=KV_BLOCKS_TOTAL,
        kv_blocks_used=used,
        kv_blocks_cached=cached,
        kv_blocks_free=KV_BLOCKS_TOTAL - used - cached,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
    )


def build_known_workload(start: float = 1000.0) -> Workload:
    steps: list[StepStats] = []
    finished: list[FinishedRequestStats] = []
    now = start + len(SPECS) * ARRIVAL_GAP_S  # every request has arrived before the first step
    for index, spec in enumerate(SPECS):
        arrival = start + index * ARRIVAL_GAP_S
        waiting = len(SPECS) - index - 1
        if not spec.ran:
            finished.append(FinishedRequestStats(spec.reason, arrival, None, None, None, now, spec.prompt, 0, 0, ()))
            continue
        first_scheduled = now
        token_times: list[float] = []
        now += STEP_S
        uncached = spec.prompt - spec.cached
        steps.append(_step(now, uncached, uncached, 1, 1, waiting, queries=spec.prompt, hits=spec.cached))
        token_times.append(now)
        while len(token_times) < spec.output:
            if spec.preempt_after is not None and len(token_times) == spec.preempt_after:
                # Preempted (its blocks freed), then recomputed: prompt + generated tokens again,
                # looked up in the prefix cache again (no hit: its blocks were evicted).
                now += STEP_S
                steps.append(_step(now, 0, 0, 0, 0, waiting + 1, preempted=1))
                recompute = spec.prompt + len(token_times)
                now += STEP_S
                steps.append(_step(now, recompute, recompute, 1, 1, waiting, queries=recompute, hits=0))
                token_times.append(now)
                continue
            now += STEP_S
            steps.append(_step(now, 1, 0, 1, 1, waiting))
            token_times.append(now)
        gaps = tuple(b - a for a, b in zip(token_times, token_times[1:]))
        finished.append(
            FinishedRequestStats(
                finish_reason=spec.reason,
                arrival_time=arrival,
                first_scheduled_time=first_scheduled,
                first_token_time=token_times[0],
                last_token_time=token_times[-1],
                finished_time=now,
                num_prompt_tokens=spec.prompt,
                num_cached_tokens=spec.cached,
                num_generation_tokens=len(token_times),
                inter_token_latencies=gaps,
            )
        )
    # A last step that finds nothing to do: the gauges must drop back to idle.
    now += STEP_S
    steps.append(_step(now, 0, 0, 0, 0, 0))
    return Workload(steps, finished)


def feed(listener: StatsListener, workload: Workload) -> None:
    """Feed each step, then the requests that finished in it, as the engine emits them."""
    pending = sorted(workload.finished, key=lambda done: done.finished_time)
    for step in workload.steps:
        listener.on_step(step)
        while pending and pending[0].finished_time <= step.timestamp:
            listener.on_request_finished(pending.pop(0))
    assert not pending, "every finished request falls within the workload's steps"
