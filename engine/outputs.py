"""What the engine hands back per request: per-step deltas, and the accumulator that turns them
into one final output.

Each step the engine reports only what is new (vLLM v1's DELTA output kind): for every completion
that gained tokens or finished, the new token ids, the new text and the new logprobs. Copying every
completion's whole output at every step would make a request cost O(output length^2). Callers that
want the whole result (`LLM.generate`, non-streaming HTTP responses) feed the deltas to
`OutputAccumulator`, which appends them (linear in the output length).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvserve.scheduler.output import TokenLogprobs
from kvserve.scheduler.request import FinishReason


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
    """One completion's news since its last report (or, from `OutputAccumulator`, its whole output)."""

    index: int
    text: str  # held-back text that might still become a stop string is not included yet
    token_ids: list[int]
    finish_reason: FinishReason | None = None  # a str enum: == "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, when asked for
    cumulative_logprob: float | None = None  # over every token so far, when logprobs were asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's news from one step: only the completions that gained tokens or finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool  # every completion of the request has finished
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # When asked for (SamplingParams.prompt_logprobs): one entry per prompt token, None for the
    # first (nothing precedes it); set once the whole prompt has been scored.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None


class _CompletionParts:
    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.cumulative_logprob is not None:
            self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason

    def output(self) -> CompletionOutput:
        return CompletionOutput(index=self.index, text="".join(self.text), token_ids=self.token_ids,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                logprobs=self.logprobs, cumulative_logprob=self.cumulative_logprob)


class OutputAccumulator:
    """Appends one request's deltas. A completion that has finished takes no further news, so a
    caller may mark every completion of a request finished (e.g. "abort") without checking which
    already were."""

    def __init__(self) -> None:
        self._latest: RequestOutput | None = None
        self._completions: dict[int, _CompletionParts] = {}

    def add(self, delta: RequestOutput) -> list[CompletionOutput]:
        """Takes one delta; returns its completions that were news (not already finished)."""
        self._latest = delta
        news = []
        for completion in delta.outputs:
            parts = self._completions.setdefault(completion.index, _CompletionParts(completion.index))
            if parts.finish_reason is not None:
                continue
            parts.add(completion)
            news.append(completion)
        return news

    def result(self) -> RequestOutput:
        """Everything so far: whole texts, token ids and logprobs, completions in index order."""
        if self._latest is None:
            raise ValueError("no output was added yet")
        outputs = [self._completions[i].output() for i in sorted(self._completions)]
        return replace(self._latest, outputs=outputs)
