"""What a tool-call parser makes of a model's output: an ordered list of segments, text and
calls, in the order they appear.

A parser is a pure function `(text so far, final) -> segments`. Called on a growing text with
final=False it returns the view so far, holding back what is still undecided (a tail that may
become a marker, an object that may become a call); called with final=True on the whole text it
returns the answer: every call complete, anything that did not parse as a call turned into text.
Streaming (stream.py) diffs successive views; the non-streamed message is the final view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TextSegment:
    text: str


@dataclass(frozen=True)
class CallSegment:
    """A tool call in the model's output, possibly still being generated."""

    name: str | None  # None until the name's string is complete
    arguments: str  # raw JSON text of the arguments object so far ("" until it starts)
    complete: bool

    @property
    def started(self) -> bool:
        """Enough is known to announce the call: its name, and its arguments have begun."""
        return self.name is not None and (bool(self.arguments) or self.complete)


Segment = TextSegment | CallSegment
OutputParser = Callable[[str, bool], list[Segment]]

# A block that may still become a call or turn out to be text: it holds back the text from its start.
UNDECIDED_CALL = CallSegment(None, "", complete=False)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as the model wrote it


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    calls: list[ParsedCall]


def parsed_message(segments: Sequence[Segment], parallel_calls: bool = True) -> ParsedMessage:
    """The final view as a message. The text outside the calls is the content, less the blanks
    right before each call and, when there are calls, at its end (the newlines and spaces a
    model writes around its call markers); content that is empty becomes None, as OpenAI sends
    a message that only calls tools. Without parallel_calls (the request's parallel_tool_calls
    false) only the first call is kept and later ones are dropped, as vLLM does; the text around
    them stays content."""
    calls: list[ParsedCall] = []
    content = ""
    for segment in segments:
        if isinstance(segment, TextSegment):
            content += segment.text
        elif segment.complete and segment.name is not None:
            calls.append(ParsedCall(segment.name, segment.arguments))
            content = content.rstrip()
    if not parallel_calls:
        calls = calls[:1]
    if calls:
        content = content.rstrip()
    return ParsedMessage(content or None, calls)


def held_marker_prefix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start (not the whole) of a marker: text
    that must not be shown yet because the next token may complete the marker."""
    longest = min(len(text), max(len(m) for m in markers) - 1)
    for length in range(longest, 0, -1):
        if any(m.startswith(text[-length:]) for m in markers):
            return length
    return 0
