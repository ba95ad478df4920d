"""What the engine hands back per request: cumulative text and tokens for each completion."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.scheduler.output import TokenLogprobs


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) of a request's life, for metrics and logs."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative; held-back text that might still become a stop string is not included
    token_ids: list[int]  # cumulative
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # cumulative, one per token, when asked for
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    metrics: RequestMetrics | None = None
