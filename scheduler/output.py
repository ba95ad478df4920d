"""The plain-data seams of the step loop:

    scheduler_output = scheduler.schedule()
    runner_output    = model_runner.execute(scheduler_output)
    updates          = scheduler.update_from_output(scheduler_output, runner_output)

Nothing here holds torch tensors, so the scheduler stays pure Python and testable with a fake model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvserve.scheduler.sampling_params import SamplingParams


class ScheduledRequest(NamedTuple):
    """One request's share of a step, in batch order.

    The runner feeds `token_ids` at positions `num_computed_tokens ...` and writes their K/V into
    the slots that `block_ids` (the whole block table) gives those positions. When `samples` is
    true the step reaches the end of the request's known tokens and one token is sampled from the
    last position's logits; a prompt chunk that stops short of the prompt's end samples nothing.

    A NamedTuple rather than a frozen dataclass: one is built per running request per step, and
    a frozen dataclass's __init__ (one object.__setattr__ per field) costs several times more.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    samples: bool
    sampling_params: SamplingParams
    seed: int
    # References (not copies) to the request's tokens, for penalties and seeded sampling.
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step: everything this step's last query attends to."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Copy-on-write: (source block, destination block) pairs whose KV the runner copies before
    # the forward pass.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


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
    """What one model step produced: a token for each scheduled request whose `samples` is set,
    in batch order, and prompt logprobs for the requests that asked for them, by request id."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
