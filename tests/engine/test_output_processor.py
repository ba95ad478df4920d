"""OutputProcessor alone (no scheduler, no model): a step's updates become one delta per request;
a stop string ends a completion and is handed back for the scheduler to finish (unless the
scheduler already did); grammar matchers advance only on constrained steps, and are dropped when
their completion ends."""

from __future__ import annotations

from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.output_tracker import OutputTracker
from kvserve.scheduler import FinishReason, RequestUpdate, SamplingParams
from kvserve.scheduler.request import Request
from tests.engine.test_llm_engine_fast import EOS, ByteTokenizer


class RecordingMatchers:
    """Stands in for StructuredOutputManager: which tokens each constrained completion accepted."""

    def __init__(self, constrained: set[str]) -> None:
        self.constrained = set(constrained)
        self.accepted: dict[str, list[int]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.constrained

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        self.accepted.setdefault(request_id, []).extend(token_ids)

    def remove(self, request_id: str) -> None:
        self.constrained.discard(request_id)


def processor(params: SamplingParams, constrained: set[str] = frozenset()) -> tuple[OutputProcessor, Request]:
    tracker = OutputTracker(ByteTokenizer())  # type: ignore[arg-type]
    request = Request("r#0", [5, 6], params, (EOS,), 0.0, parent_id="r", index=0)
    tracker.add("r", "hi", [request])
    return OutputProcessor(tracker, RecordingMatchers(constrained)), request  # type: ignore[arg-type]


def update(request: Request, text: str, finished: bool = False) -> RequestUpdate:
    return RequestUpdate(request, ByteTokenizer().encode(text), [None] * len(text.encode()), finished)


def test_a_stop_string_is_cut_and_handed_back_for_the_scheduler_to_finish():
    proc, request = processor(SamplingParams(max_tokens=10, stop=["lo"]))
    first = proc.process([update(request, "hel")], {}, 1.0, constrained=False)
    assert [o.outputs[0].text for o in first.outputs] == ["he"] and not first.stopped  # "l" held back
    second = proc.process([update(request, "lo")], {}, 2.0, constrained=False)
    assert second.stopped == [("r#0", "lo")]
    (output,) = second.outputs
    assert output.finished and output.outputs[0].text == "l" and output.outputs[0].stop_reason == "lo"
    assert [s.finish_reason for s in second.finished] == [FinishReason.STOP]
    assert "r" not in proc.tracker.groups  # nothing left behind


def test_a_stop_string_in_the_step_the_scheduler_ended_is_not_handed_back():
    proc, request = processor(SamplingParams(max_tokens=2, stop=["i"]))
    request.finish_reason = FinishReason.LENGTH
    step = proc.process([update(request, "hi", finished=True)], {}, 1.0, constrained=False)
    assert step.stopped == [] and step.outputs[0].outputs[0].finish_reason == "stop"


def test_matchers_advance_on_constrained_steps_only_and_go_when_their_completion_ends():
    proc, request = processor(SamplingParams(max_tokens=10, stop=["!"]), constrained={"r#0"})
    proc.process([update(request, "a")], {}, 1.0, constrained=False)  # no row masked: nothing to advance
    proc.process([update(request, "b")], {}, 2.0, constrained=True)
    assert proc.structured_output.accepted == {"r#0": ByteTokenizer().encode("b")}
    proc.process([update(request, "!")], {}, 3.0, constrained=True)
    assert "r#0" not in proc.structured_output  # ended by its stop string
