"""Drives a real Scheduler and KV cache manager with the fake model, and checks invariants."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.paging import KVCacheManager, SlidingWindowSpec
from kvserve.scheduler import (
    Request,
    RequestUpdate,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tests.scheduler.fake_model import FakeModelRunner, StepInput

BLOCK_SIZE = 8
VOCAB_SIZE = 32
EOS = VOCAB_SIZE  # outside the fake model's vocabulary: never sampled unless a test says so


def make_request(
    request_id: str,
    prompt: list[int] | int,
    *,
    arrival: float | None = None,
    priority: int = 0,
    eos: int | None = EOS,
    parent_id: str | None = None,
    index: int = 0,
    seed: int = 0,
    **params: object,
) -> Request:
    """`prompt` is token ids, or a length (tokens derived from the id, so prompts differ)."""
    if isinstance(prompt, int):
        start = zlib.crc32(request_id.encode())  # stable across runs, unlike hash(str)
        prompt = [(start + i) % VOCAB_SIZE for i in range(prompt)]
    params.setdefault("max_tokens", 4)
    params.setdefault("ignore_eos", False)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_ids=() if eos is None else (eos,),
        arrival_time=0.0 if arrival is None else arrival,
        priority=priority,
        parent_id=parent_id,
        index=index,
        seed=seed,
    )


def make_config(**overrides: object) -> SchedulerConfig:
    """A SchedulerConfig whose max_model_len fits the small caches these tests use."""
    overrides.setdefault("max_model_len", 64)
    return SchedulerConfig(**overrides)


@dataclass
class StepRecord:
    output: SchedulerOutput
    updates: list[RequestUpdate]
    inputs: list[StepInput]  # what the runner computed, per scheduled request

    @property
    def batch(self) -> list[tuple[str, int]]:
        """(request id, tokens scheduled) in batch order."""
        return [(r.request_id, r.num_new_tokens) for r in self.output.scheduled]


@dataclass
class Harness:
    num_blocks: int
    block_size: int = BLOCK_SIZE
    enable_prefix_caching: bool = True
    config: SchedulerConfig = field(default_factory=make_config)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, Request] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)

    group_specs: list | None = None  # None: one group
    # Speculative decoding: drafts for a request that gained tokens (the engine's drafter's job).
    drafter: Callable[[Request], list[int]] | None = None

    _last_drafts: dict[str, int] = field(default_factory=dict)
    _forced: dict[str, int] = field(default_factory=dict)  # tokens appended since the last step

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(self.num_blocks, self.block_size, self.enable_prefix_caching, self.group_specs)
        self.scheduler = Scheduler(self.config, self.kv)
        windows = [spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
                   for spec in self.group_specs or [None]]
        self.runner = FakeModelRunner(self.num_blocks, self.block_size, VOCAB_SIZE, windows)

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.outputs[request.request_id] = []
            self.scheduler.add_request(request)

    def schedule(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self.check_output(output)
        return output

    def update(self, output: SchedulerOutput) -> list[RequestUpdate]:
        runner_output = self.runner.execute(output)
        known = self.scheduler._requests
        for step_input in self.runner.last_inputs:  # the runner's view, rebuilt from diffs, is the scheduler's
            request = known.get(step_input.request_id)
            if request is not None:  # else finished since schedule(): the next step tells the runner
                start = step_input.num_computed_tokens
                assert step_input.token_ids == request.all_token_ids[start:start + len(step_input.token_ids)]
        leftover = set(self.runner.requests) - set(known)
        assert leftover <= set(self.scheduler._finished_req_ids), f"the runner was never told {leftover} ended"
        updates = self.scheduler.update_from_output(output, runner_output)
        for update in updates:
            self.outputs[update.request.request_id].extend(update.new_token_ids)
            if update.finished:
                self.finished[update.request.request_id] = update.request
            elif self.drafter is not None and update.new_token_ids:
                update.request.spec_token_ids = self.drafter(update.request)
        self.steps.append(StepRecord(output, updates, self.runner.last_inputs))
        return updates

    def force(self, request_id: str, token_ids: list[int]) -> RequestUpdate:
        """Tokens appended without sampling (the engine's jump-forward decoding)."""
        update = self.scheduler.append_forced_tokens(request_id, token_ids)
        self.outputs[request_id].extend(update.new_token_ids)
        self._forced[request_id] = self._forced.get(request_id, 0) + len(update.new_token_ids)
        if update.finished:
            self.finished[request_id] = update.request
        return update

    def step(self) -> StepRecord:
        self.update(self.schedule())
        return self.steps[-1]

    def run(self, max_steps: int = 10_000) -> list[StepRecord]:
        start = len(self.steps)
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return self.steps[start:]
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps")

    def abort(self, *request_ids: str) -> list[Request]:
        from kvserve.scheduler import FinishReason

        aborted = self.scheduler.finish_requests(request_ids, FinishReason.ABORT)
        for request in aborted:
            self.finished[request.request_id] = request
        return aborted

    def check_output(self, output: SchedulerOutput) -> None:
        """Invariants of every step."""
        config = self.config
        assert output.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        assert self.scheduler.num_running <= config.max_num_seqs
        ids = [r.request_id for r in output.scheduled]
        assert len(ids) == len(set(ids)), "a request appears twice in one step"
        for scheduled in output.scheduled:
            assert scheduled.num_new_tokens >= 1
            # A step's diff stays small: the tokens since the last step, whole tables only when needed.
            if not scheduled.tables_replaced:  # a decode's token, or the tokens a verifying step kept
                assert len(scheduled.new_token_ids) <= (1 + self._last_drafts.get(scheduled.request_id, 0)
                                                        + self._forced.get(scheduled.request_id, 0))
            if config.long_prefill_token_threshold:
                assert scheduled.num_new_tokens <= config.long_prefill_token_threshold
        # A window group holds no more than its window and the step need.
        for group, spec in enumerate(self.group_specs or []):
            if isinstance(spec, SlidingWindowSpec):
                for scheduled in output.scheduled:
                    held = sum(b is not None for b in self.kv.block_ids(scheduled.request_id, group))
                    assert held <= spec.max_num_blocks(scheduled.seq_len, self.block_size, scheduled.num_new_tokens)
        # No physical block is in two tables unless the prefix cache or a fork shares it, and
        # then only on the positions both have computed, which the fake model checks.
        stats = self.kv.stats()
        assert stats.blocks_used + stats.blocks_cached + stats.blocks_free == stats.blocks_total
        self._last_drafts = {s.request_id: len(s.spec_token_ids) for s in output.scheduled}
        self._forced = {}

    def assert_idle(self) -> None:
        assert not self.scheduler.has_unfinished_requests()
        assert self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0
        stats = self.kv.stats()
        assert stats.blocks_used == 0, f"{stats.blocks_used} blocks still held at idle"
        assert stats.blocks_free + stats.blocks_cached == stats.blocks_total
