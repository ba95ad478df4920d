"""One streamed choice's tool calls: feeds the parser each text delta and turns the change in
its view into OpenAI's deltas.

    content  "Let me check."                       text outside calls, as soon as it is decided
    call     {"index": 0, "id": "call_…", "type": "function",
              "function": {"name": "get_weather", "arguments": ""}}      once the name is known
    args     {"index": 0, "function": {"arguments": "{\"city\": "}}      then fragments as generated

Segments are matched by position between views (a parser never reorders them). A segment still
undecided may turn from call to text as long as nothing of the call was sent; a call already
announced that then fails to parse (only when the reply is cut off inside it) is left as sent.
Each delta re-parses the whole text: that keeps parsers pure functions of the text, and costs
little because text outside calls is searched for markers by str.find and calls are short (the
work per delta grows with the calls written so far, not with the reply).
Blank text is held until more text follows it, and dropped when a call follows it or, at the
end, when there were calls: that keeps the streamed content equal to the non-streamed one
(segments.parsed_message).
Without parallel calls (parallel_tool_calls false) only the first call is announced; later
ones are never sent (vLLM sends only index 0), and the text around them still streams.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.tool_parsers.call_ids import new_call_id
from kvserve.server.tool_parsers.segments import CallSegment, OutputParser, TextSegment, parsed_message


@dataclass
class _Sent:
    """What was sent for one segment position."""

    text_chars: int = 0
    call_index: int | None = None  # set once the call was announced
    argument_chars: int = 0
    call_started: bool = False  # a call began here (announced or, past the first without parallel calls, not)


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool-call delta entries
    has_calls: bool = False  # on the final delta: the reply's finish_reason is "tool_calls"


class ToolCallStream:
    def __init__(self, parser: OutputParser, new_id: Callable[[], str] = new_call_id,
                 parallel_calls: bool = True) -> None:
        self._parser = parser
        self._new_id = new_id
        self._parallel_calls = parallel_calls
        self._text = ""
        self._sent: list[_Sent] = []
        self._calls_announced = 0
        self._blank = ""  # held blanks at the end of the content sent so far

    def feed(self, text: str, final: bool) -> StreamDelta:
        self._text += text
        segments = self._parser(self._text, final)
        shown: list[str] = []
        calls: list[dict[str, Any]] = []
        for position, segment in enumerate(segments):
            if position == len(self._sent):
                self._sent.append(_Sent())
            sent = self._sent[position]
            if isinstance(segment, TextSegment):
                if sent.call_index is None:  # an announced call that failed stays as sent
                    shown.append(self._show(segment.text[sent.text_chars:]))
                    sent.text_chars = len(segment.text)
                continue
            if segment.started and not sent.call_started:
                sent.call_started = True
                self._blank = ""  # the blanks before a call are not content
            calls.extend(self._call_deltas(segment, sent))
        has_calls = final and bool(parsed_message(segments, self._parallel_calls).calls)
        if final and not has_calls:
            shown.append(self._blank)
            self._blank = ""
        return StreamDelta("".join(shown), calls, has_calls)

    def _call_deltas(self, call: CallSegment, sent: _Sent) -> list[dict[str, Any]]:
        deltas = []
        if sent.call_index is None:
            if not call.started or (self._calls_announced and not self._parallel_calls):
                return []
            sent.call_index = self._calls_announced
            self._calls_announced += 1
            deltas.append({"index": sent.call_index, "id": self._new_id(), "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
        if len(call.arguments) > sent.argument_chars:
            deltas.append({"index": sent.call_index, "function": {"arguments": call.arguments[sent.argument_chars:]}})
            sent.argument_chars = len(call.arguments)
        return deltas

    def _show(self, new: str) -> str:
        """`new` text as far as it can be shown: blanks at its end wait for what follows."""
        pending = self._blank + new
        shown = pending.rstrip()
        self._blank = pending[len(shown):]
        return shown
