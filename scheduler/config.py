"""The scheduler's settings: one frozen dataclass that validates itself."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SchedulerConfigError(ValueError):
    """A scheduler setting is invalid; `field_name` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field_name = field_name


class SchedulingPolicy(str, enum.Enum):
    """The order in which waiting requests are admitted (and running ones are preempted, in
    reverse). A str enum, so `config.policy == "fcfs"` reads naturally."""

    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # (priority, arrival): a lower priority value runs first, as in vLLM


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # running requests at most (the largest batch the runner sees)
    max_num_batched_tokens: int = 2048  # tokens per step, all requests together
    max_model_len: int = 8192  # prompt + output tokens of one request at most
    policy: SchedulingPolicy | str = SchedulingPolicy.FCFS
    # Cap on one request's chunk per step (0 = none): keeps one long prompt from taking a whole
    # step's budget, so the prompts queued behind it start sooner.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        valid = ", ".join(repr(p.value) for p in SchedulingPolicy)
        try:
            object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        except ValueError:
            raise SchedulerConfigError("policy", f"policy must be one of {valid}, got {self.policy!r}") from None
        for name, value, minimum in (
            ("max_num_seqs", self.max_num_seqs, 1),
            ("max_num_batched_tokens", self.max_num_batched_tokens, 1),
            ("max_model_len", self.max_model_len, 1),
            ("long_prefill_token_threshold", self.long_prefill_token_threshold, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise SchedulerConfigError(name, f"{name} must be an integer >= {minimum}, got {value!r}")
