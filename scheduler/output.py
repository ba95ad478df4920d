"""The plain-data seams of the step loop:

    scheduler_output = scheduler.schedule()
    runner_output    = model_runner.execute(scheduler_output)
    updates          = scheduler.update_from_output(scheduler_output, runner_output)

Nothing here holds torch tensors, so the scheduler stays pure Python and testable with a fake
model. Nothing here holds references to the scheduler's live state either: a SchedulerOutput is
plain data that can be pickled to another process (tensor-parallel workers) as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvserve.paging import GroupBlockIds
from kvserve.scheduler.sampling_params import SamplingParams


class NewRequestData(NamedTuple):
    """What the runner keeps of a request for its whole life, sent once: the first step that
    schedules it. Its tokens and block ids come through its ScheduledRequest, like every later
    change, so the runner's state is exactly what the step diffs built."""

    request_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int


class ScheduledRequest(NamedTuple):
    """One request's share of a step, as a change to what the runner already holds of it.

    The runner appends `new_token_ids` (tokens the request gained since the previous step that
    scheduled it: its prompt the first time, then the token(s) it last sampled) and
    `new_block_ids` (one tuple per layer group) to its copy of the request, then computes
    `num_new_tokens` tokens at positions `num_computed_tokens ...`, writing their K/V into the
    slots the block tables give those positions (a decode with drafts computes its last token
    and then its `spec_token_ids`). `tables_replaced` says that `new_block_ids`
    are the whole tables, to replace the runner's: the first time, after a preemption, and after
    copy-on-write moved a block. When `samples` is true the step reaches the end of the
    request's known tokens and a token is sampled from the last position's logits; a prompt
    chunk that stops short of the prompt's end samples nothing.

    What a step sends therefore does not grow with a request's length: a decode step sends one
    token, and block ids only when a block was added. A NamedTuple rather than a frozen
    dataclass: one is built per running request per step, and a frozen dataclass's __init__ (one
    object.__setattr__ per field) costs several times more.
    """

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool
    new_token_ids: list[int]
    new_block_ids: GroupBlockIds
    tables_replaced: bool
    # Draft tokens verified this step (speculative decoding): computed after the request's last
    # token and counted in num_new_tokens, but not part of the request until accepted.
    spec_token_ids: Sequence[int] = ()

    @property
    def seq_len(self) -> int:
        """Context length after this step: everything this step's last query attends to."""
        return self.num_computed_tokens + self.num_new_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # in batch order
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests the runner was told of that ended (finished, aborted) since the previous step:
    # it drops what it keeps of them.
    finished_req_ids: list[str] = field(default_factory=list)
    # Copy-on-write: (source block, destination block) pairs whose KV the runner copies before
    # the forward pass.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner: no request runs and none it holds has ended. (A step that
        only reports finished requests still goes to the runner, which drops their state.)"""
        return not self.scheduled and not self.finished_req_ids


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities for one sampled token: its own, its rank (1 = most likely), and the
    top-N alternatives as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens scored in one step: `entries[i]` is prompt token
    `first_position + i` given the tokens before it (a chunked prefill yields several pieces)."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one model step produced: for each scheduled request whose `samples` is set, the
    tokens it gained (one; several when a step verifies drafted tokens), with their logprobs
    when the request asked for them (None otherwise), and prompt logprobs for the requests that
    asked for them, by request id."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
