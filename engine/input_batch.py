"""The runner's persistent copy of the requests it serves, built only from the step diffs
(vLLM v1's CachedRequestState / InputBatch).

    SchedulerOutput ─► finished_req_ids: dropped
                     ─► new_requests:     a CachedRequestState each (params, seed, prompt length)
                     ─► scheduled:        new tokens and new block ids appended (tables replaced
                                          when the diff says so); this step's share recorded
                     ─► the step's states, in the scheduler's order

A step therefore costs the runner what changed, not what a request has accumulated, and a
tensor-parallel worker that receives the same diffs holds the same states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.scheduler.output import NewRequestData, SchedulerOutput
from kvserve.scheduler.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequestState:
    request_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    all_token_ids: list[int] = field(default_factory=list)  # prompt, then outputs, as they were sent
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # one table per layer group
    # This step's share, set by InputBatch.apply.
    num_computed_tokens: int = 0
    num_new_tokens: int = 0
    samples: bool = False
    spec_token_ids: Sequence[int] = ()  # drafts computed after the last token (counted in num_new_tokens)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    def step_token_ids(self) -> list[int]:
        """The tokens this step computes, at positions num_computed_tokens onwards: its own, then
        its drafts."""
        start = self.num_computed_tokens
        own = self.all_token_ids[start:start + self.num_new_tokens - len(self.spec_token_ids)]
        return own + list(self.spec_token_ids) if self.spec_token_ids else own

    def append_tokens(self, token_ids: list[int]) -> None:
        all_token_ids = self.all_token_ids
        start = len(all_token_ids)
        all_token_ids.extend(token_ids)
        if start >= self.num_prompt_tokens:  # a decode's token: the common case
            self.output_token_ids.extend(token_ids)
        elif len(all_token_ids) > self.num_prompt_tokens:
            self.output_token_ids.extend(all_token_ids[self.num_prompt_tokens:])


class InputBatch:
    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.requests: dict[str, CachedRequestState] = {}

    def apply(self, output: SchedulerOutput) -> list[CachedRequestState]:
        """Applies one step's diffs; returns the step's states in the scheduler's order."""
        requests = self.requests
        for request_id in output.finished_req_ids:
            requests.pop(request_id, None)
        for new in output.new_requests:
            requests[new.request_id] = self._new_state(new)
        states = []
        for scheduled in output.scheduled:
            state = requests.get(scheduled.request_id)
            if state is None:
                raise ValueError(f"the step schedules {scheduled.request_id!r}, which the runner was never sent "
                                 "as a new request (or was told has finished)")
            if scheduled.new_token_ids:
                state.append_tokens(scheduled.new_token_ids)
            if scheduled.tables_replaced:
                state.block_ids = [list(table) for table in scheduled.new_block_ids]
            elif scheduled.new_block_ids:
                for table, new_blocks in zip(state.block_ids, scheduled.new_block_ids):
                    table.extend(new_blocks)
            state.num_computed_tokens = scheduled.num_computed_tokens
            state.num_new_tokens = scheduled.num_new_tokens
            state.samples = scheduled.samples
            state.spec_token_ids = scheduled.spec_token_ids
            states.append(state)
        return states

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        if new.request_id in self.requests:
            raise ValueError(f"request {new.request_id!r} was sent as new twice without finishing in between")
        return CachedRequestState(new.request_id, new.num_prompt_tokens, new.sampling_params, new.seed,
                                  block_ids=[[] for _ in range(self.num_groups)])
