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


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as the model wrote it


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    calls: list[ParsedCall]


def parsed_message(segments: Sequence[Segment]) -> ParsedMessage:
    """The final view as a message. The text outside the calls is the content; blanks trailing
    it are dropped when there are calls (the newlines a model writes around its call markers),
    and content that is empty becomes None, as OpenAI sends a message that only calls tools."""
    calls = [ParsedCall(s.name, s.arguments) for s in segments
             if isinstance(s, CallSegment) and s.complete and s.name is not None]
    content = "".join(s.text for s in segments if isinstance(s, TextSegment))
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
