"""Llama 3.1-3.3 write a call as a JSON object, optionally after the <|python_tag|> token, and
several calls separated by semicolons:

    Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

As vLLM's llama3_json parser, a call may stand anywhere in the reply (Llama often writes a few
words first), with "parameters" or "arguments". Unlike vLLM, which drops all text once it finds
a call, the text outside the calls is the content; a `;` right after a call is the separator,
not content. <|python_tag|> is a control token that vanishes when special tokens are skipped
(the default), so a bare object is read the same.

A `{` that opens no call: a complete JSON value is text as a whole (a call-shaped object nested
in it is data, not a call); text that is not JSON ends the search, the rest of the reply is text
(vLLM turns the whole reply into content in both cases). Streamed, the text from a `{` on waits
until the object is known to be a call or not.
"""

from __future__ import annotations

from kvserve.server.tool_parsers.json_scan import Incomplete, Malformed, scan_call, skip_whitespace, value_end
from kvserve.server.tool_parsers.segments import UNDECIDED_CALL, Segment, TextSegment, held_marker_prefix

LLAMA3_TAG = "<|python_tag|>"
SEPARATOR = ";"


def parse_llama3_json(text: str, final: bool) -> list[Segment]:
    segments: list[Segment] = []
    text_from = 0  # the text from here on is not in a segment yet
    pos = 0  # where the search for the next call goes on
    while True:
        start = _next_candidate(text, pos)
        if start is None:
            rest = text[text_from:]
            held = 0 if final else held_marker_prefix(rest, (LLAMA3_TAG,))
            return [*segments, TextSegment(rest[:len(rest) - held])]
        before = TextSegment(text[text_from:start])
        body = start
        if text.startswith(LLAMA3_TAG, start):
            body = skip_whitespace(text, start + len(LLAMA3_TAG))
            if body >= len(text) and not final:
                return [*segments, before, UNDECIDED_CALL]
            if body >= len(text) or text[body] != "{":
                pos = body  # the tag opens code for Llama's interpreter, not a call: it stays text
                continue
        try:
            call, end = scan_call(text, body)
            if end is None and final:
                raise Malformed
        except Malformed:
            try:
                pos = value_end(text, body)
            except Incomplete:
                if not final:
                    return [*segments, before, UNDECIDED_CALL]
                return [*segments, before, TextSegment(text[start:])]
            except Malformed:
                return [*segments, before, TextSegment(text[start:])]
            segments += [before, TextSegment(text[start:pos])]  # JSON, but not a call
            text_from = pos
            continue
        if end is None:
            return [*segments, before, call]
        segments += [before, call]
        after = skip_whitespace(text, end)
        if after >= len(text) and not final:
            return segments  # a separator may follow; the blanks wait
        if text.startswith(SEPARATOR, after):
            end = after + len(SEPARATOR)
        text_from = pos = end


def _next_candidate(text: str, pos: int) -> int | None:
    """Where the next call may start: a `{` or the tag."""
    starts = [i for i in (text.find("{", pos), text.find(LLAMA3_TAG, pos)) if i >= 0]
    return min(starts) if starts else None
