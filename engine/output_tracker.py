"""Turns the scheduler's per-token updates into user-facing RequestOutput deltas.

One user request with n completions becomes n scheduler Requests (ids "<id>#<index>"); this
module groups them back, detokenizes each completion incrementally, finds stop strings, and
records the timestamps metrics need. Each completion buffers only what is new since its last
report; `RequestGroup.take_output` hands that over and starts a fresh buffer, so the work per
step is proportional to the new tokens, never to the output so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.engine.stats import FinishedRequestStats
from kvserve.engine.text.detokenizer import IncrementalDetokenizer
from kvserve.engine.text.tokenizer import Tokenizer
from kvserve.scheduler.output import PromptLogprobs, TokenLogprobs
from kvserve.scheduler.request import FinishReason, Request


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass
class CompletionState:
    request: Request
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    wants_logprobs: bool
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Not yet reported: text pieces, token ids, logprobs, and whether the finish was reported.
    new_text: list[str] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reported: bool = False

    @property
    def has_news(self) -> bool:
        return bool(self.new_token_ids or self.new_text) or (
            self.finish_reason is not None and not self.finish_reported)

    def take_delta(self) -> CompletionOutput:
        delta = CompletionOutput(
            index=self.request.index,
            text="".join(self.new_text),
            token_ids=self.new_token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.new_logprobs if self.wants_logprobs else None,
            cumulative_logprob=self.cumulative_logprob if self.wants_logprobs else None,
        )
        self.new_text, self.new_token_ids, self.new_logprobs = [], [], []
        self.finish_reported = self.finish_reason is not None
        return delta

    def finished_stats(self, reason: FinishReason, now: float) -> FinishedRequestStats:
        times = self.metrics.token_times
        return FinishedRequestStats(
            finish_reason=reason,
            arrival_time=self.metrics.arrival_time,
            first_scheduled_time=self.metrics.first_scheduled_time,
            first_token_time=self.metrics.first_token_time,
            last_token_time=self.metrics.last_token_time,
            finished_time=now,
            num_prompt_tokens=self.request.num_prompt_tokens,
            num_cached_tokens=self.request.num_cached_tokens or 0,
            num_generation_tokens=self.request.num_output_tokens,
            inter_token_latencies=tuple(b - a for a, b in zip(times, times[1:])),
        )


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[CompletionState] = field(default_factory=list)
    # Prompt logprobs scored so far (entry 0 is None), or None when not asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add_prompt_logprobs(self, piece: PromptLogprobs) -> None:
        """Appends a scored piece of the prompt. A preempted request recomputes its prompt, so a
        piece may repeat positions already held: only the new ones are kept."""
        if self.prompt_logprobs is None:
            return
        skip = len(self.prompt_logprobs) - piece.first_position
        if skip >= 0:
            self.prompt_logprobs.extend(piece.entries[skip:])

    @property
    def complete_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        logprobs = self.prompt_logprobs
        return logprobs if logprobs is not None and len(logprobs) == len(self.prompt_token_ids) else None

    @property
    def finished(self) -> bool:
        # A loop rather than all(<generator>): this runs twice per request per step.
        for completion in self.completions:
            if completion.finish_reason is None:
                return False
        return True

    def take_output(self) -> RequestOutput | None:
        """The group's news since its last report, or None when there is none."""
        news = [c.take_delta() for c in self.completions if c.has_news]
        if not news:
            return None
        cached = max(c.request.num_cached_tokens or 0 for c in self.completions)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=news,
            finished=self.finished,
            num_cached_tokens=cached,
            metrics=self.completions[0].metrics,
            prompt_logprobs=self.complete_prompt_logprobs,
        )


class OutputTracker:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self.completions: dict[str, tuple[RequestGroup, CompletionState]] = {}

    def add(self, request_id: str, prompt: str | None, requests: list[Request]) -> None:
        group = RequestGroup(request_id, prompt, requests[0].prompt_token_ids)
        if requests[0].sampling_params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for request in requests:
            params = request.sampling_params
            state = CompletionState(
                request=request,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                ),
                metrics=RequestMetrics(arrival_time=request.arrival_time),
                wants_logprobs=params.logprobs is not None,
            )
            group.completions.append(state)
            self.completions[request.request_id] = (group, state)
        self.groups[request_id] = group

    def child_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [c.request.request_id for c in group.completions] if group else []

    def mark_scheduled(self, child_id: str, now: float) -> None:
        entry = self.completions.get(child_id)
        if entry is not None and entry[1].metrics.first_scheduled_time is None:
            entry[1].metrics.first_scheduled_time = now

    def on_tokens(
        self, child_id: str, token_ids: list[int], logprobs: list[TokenLogprobs | None], now: float,
        ended_by_stop_token: bool = False,
    ) -> str | None:
        """Records new tokens; returns the stop string if the text now contains one.

        ended_by_stop_token: the last token is the EOS or stop token id that ended the completion.
        Its id is kept, but its text is left out unless include_stop_str_in_output (as vLLM): with
        skip_special_tokens off, "<|im_end|>" would otherwise end every reply."""
        group, state = self.completions[child_id]
        if not token_ids:
            return None
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.token_times.extend([now] * len(token_ids))
        state.new_token_ids.extend(token_ids)
        if state.wants_logprobs:
            for entry in logprobs:
                if entry is not None:
                    state.new_logprobs.append(entry)
                    state.cumulative_logprob += entry.logprob
        if ended_by_stop_token and not state.request.sampling_params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        update = state.detokenizer.append(token_ids)
        if update.new_text:
            state.new_text.append(update.new_text)
        return update.stop_string

    def on_finished(self, child_id: str, reason: FinishReason, stop_reason: int | str | None,
                    now: float) -> FinishedRequestStats:
        """Records the end of a completion; a second report (an abort racing a stop) keeps the first."""
        group, state = self.completions[child_id]
        if state.finish_reason is not None:
            return state.finished_stats(state.finish_reason, now)
        held_back = state.detokenizer.flush()  # empty after a stop string
        if held_back:
            state.new_text.append(held_back)
        state.finish_reason = reason
        state.stop_reason = stop_reason
        state.metrics.finished_time = now
        return state.finished_stats(reason, now)

    def on_prompt_logprobs(self, child_id: str, piece: PromptLogprobs) -> None:
        entry = self.completions.get(child_id)
        if entry is not None:  # None: aborted between the step's schedule and now
            entry[0].add_prompt_logprobs(piece)

    def group_of(self, child_id: str) -> RequestGroup:
        return self.completions[child_id][0]

    def pop_if_finished(self, group: RequestGroup) -> None:
        if group.finished:
            self.groups.pop(group.request_id, None)
            for c in group.completions:
                self.completions.pop(c.request.request_id, None)
