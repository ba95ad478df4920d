"""One generation request as the scheduler tracks it: its tokens, its progress, its fate."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV will be recomputed
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended, spelled as the OpenAI API spells `finish_reason`."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the client went away, or the server aborted it

    def __str__(self) -> str:
        # The wire spelling wherever it is printed (f-strings, Prometheus labels), as StrEnum
        # does from Python 3.11; JSON encoders already write the value (it is a str).
        return self.value


@dataclass(eq=False)
class Request:
    """A request's state. There is no prefill or decode phase: the request has `num_tokens`
    tokens (prompt + generated) and `num_computed_tokens` of them have KV in the cache; each step
    the scheduler gives it some of the difference.

    With `n > 1` the engine adds one Request per completion; they share `parent_id` and the
    prompt, and differ in `index` (and in their effective seed).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Every token that ends generation (a model may have several, e.g. Llama 3's <|eot_id|>
    # beside <|end_of_text|>); ignore_eos disables them all.
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    parent_id: str | None = None
    index: int = 0
    # Effective seed for the sampler: the user's seed (mixed with `index`), or a random one.
    seed: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    # Prompt followed by output, kept as one growing list so the per-step path never concatenates.
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache; None until first scheduled
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # What the model runner holds of it (the step diffs' bookkeeping, kept by the scheduler):
    # how many of all_token_ids it was sent, and whether its copy of the block tables is current
    # (not before the first step, nor after a preemption freed the blocks).
    num_sent_tokens: int = 0
    runner_has_tables: bool = False
    # Draft tokens to verify with its next decode (speculative decoding), set by the engine
    # after each step; the scheduler schedules as many of them as fit.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
