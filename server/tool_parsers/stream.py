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
Blank text is held until more text follows it, and dropped at the end when there were calls:
that keeps the streamed content equal to the non-streamed one (segments.parsed_message).
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


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool-call delta entries
    has_calls: bool = False  # on the final delta: the reply's finish_reason is "tool_calls"


class ToolCallStream:
    def __init__(self, parser: OutputParser, new_id: Callable[[], str] = new_call_id) -> None:
        self._parser = parser
        self._new_id = new_id
        self._text = ""
        self._sent: list[_Sent] = []
        self._calls_announced = 0
        self._blank = ""  # held blanks at the end of the content sent so far

    def feed(self, text: str, final: bool) -> StreamDelta:
        self._text += text
        segments = self._parser(self._text, final)
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        for position, segment in enumerate(segments):
            if position == len(self._sent):
                self._sent.append(_Sent())
            sent = self._sent[position]
            if isinstance(segment, TextSegment):
                if sent.call_index is None:  # an announced call that failed stays as sent
                    content.append(segment.text[sent.text_chars:])
                    sent.text_chars = len(segment.text)
            else:
                calls.extend(self._call_deltas(segment, sent))
        has_calls = final and bool(parsed_message(segments).calls)
        return StreamDelta(self._content("".join(content), final, has_calls), calls, has_calls)

    def _call_deltas(self, call: CallSegment, sent: _Sent) -> list[dict[str, Any]]:
        deltas = []
        if sent.call_index is None:
            if not call.started:
                return []
            sent.call_index = self._calls_announced
            self._calls_announced += 1
            deltas.append({"index": sent.call_index, "id": self._new_id(), "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
        if len(call.arguments) > sent.argument_chars:
            deltas.append({"index": sent.call_index, "function": {"arguments": call.arguments[sent.argument_chars:]}})
            sent.argument_chars = len(call.arguments)
        return deltas

    def _content(self, new: str, final: bool, has_calls: bool) -> str:
        pending = self._blank + new
        shown = pending.rstrip()
        self._blank = pending[len(shown):]
        if final and not has_calls:
            shown, self._blank = shown + self._blank, ""
        return shown
