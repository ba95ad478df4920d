"""OutputProcessor: one step's scheduler updates in, the user's RequestOutput deltas out.

    LLMEngine.step:  scheduler.schedule() -> runner.execute() -> scheduler.update_from_output()
                     -> OutputProcessor.process(updates)  (this module: everything the user sees)

For each completion that gained tokens it detokenizes them and looks for stop strings
(OutputTracker), advances its grammar matcher by the tokens sampled, and records a finish (the
scheduler's EOS / stop-token / length stop, or a stop string); then it hands over, per request,
the delta since the last report. What it does not own it returns as plain data: the completions
a stop string ended (the scheduler still runs them) and the finished requests' stats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvserve.engine.output_tracker import OutputTracker
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.stats import FinishedRequestStats
from kvserve.engine.structured_output import StructuredOutputManager
from kvserve.scheduler import RequestUpdate
from kvserve.scheduler.output import PromptLogprobs
from kvserve.scheduler.request import FinishReason


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput] = field(default_factory=list)  # one delta per request with news
    # (completion id, stop string): ended by a stop string; the scheduler must still finish them.
    stopped: list[tuple[str, str]] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    forced: list[RequestUpdate] = field(default_factory=list)  # jump-forward's tokens (see process)


class OutputProcessor:
    def __init__(self, tracker: OutputTracker, structured_output: StructuredOutputManager) -> None:
        self.tracker = tracker
        self.structured_output = structured_output

    def process(self, updates: Sequence[RequestUpdate], prompt_logprobs: Mapping[str, PromptLogprobs], now: float,
                *, constrained: bool,
                jump_forward: Callable[[Sequence[RequestUpdate]], list[RequestUpdate]] | None = None) -> ProcessedStep:
        """`constrained`: some row of the step was masked by a grammar. Without one, no matcher
        can need advancing (a constrained row that did not sample gained no token).
        `jump_forward`: called once the sampled tokens are in (grammars advanced, stop strings
        found); the tokens it appends without sampling (engine: text a grammar forces) go into
        the same deltas."""
        step = ProcessedStep()
        tracker = self.tracker
        for child_id, piece in prompt_logprobs.items():
            tracker.on_prompt_logprobs(child_id, piece)
        touched = {}
        for update in updates:
            self._record(update, step, touched, now, constrained)
        if jump_forward is not None:
            step.forced = jump_forward(updates)
            for update in step.forced:
                self._record(update, step, touched, now, True)
        for group in touched.values():
            output = group.take_output()
            if output is not None:
                step.outputs.append(output)
            tracker.pop_if_finished(group)
        return step

    def _record(self, update: RequestUpdate, step: ProcessedStep, touched: dict, now: float, constrained: bool) -> None:
        tracker = self.tracker
        request = update.request
        child_id = request.request_id
        group = tracker.group_of(child_id)
        touched[group.request_id] = group
        # The scheduler's stop check ends a request on its EOS / stop token id (reason STOP);
        # stop strings end it here, after detokenizing.
        ended_by_stop_token = update.finished and request.finish_reason is FinishReason.STOP
        stop_string = tracker.on_tokens(child_id, update.new_token_ids, update.logprobs, now, ended_by_stop_token)
        if constrained and child_id in self.structured_output:
            self.structured_output.accept(child_id, update.new_token_ids)
            if update.finished or stop_string is not None:
                self.structured_output.remove(child_id)
        if stop_string is not None:
            if not update.finished:
                step.stopped.append((child_id, stop_string))
            step.finished.append(tracker.on_finished(child_id, FinishReason.STOP, stop_string, now))
        elif update.finished and request.finish_reason is not None:  # the scheduler's stop check set it
            step.finished.append(tracker.on_finished(child_id, request.finish_reason, request.stop_reason, now))
