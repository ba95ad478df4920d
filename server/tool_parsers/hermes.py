"""Hermes 2 Pro and Qwen 2.5/3 write each call as a tagged JSON object, anywhere in the reply:

    Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

The tags are ordinary text in these vocabularies, so they survive skipped special tokens.
"""

from __future__ import annotations

from kvserve.server.tool_parsers.json_scan import Malformed, scan_call, skip_whitespace
from kvserve.server.tool_parsers.segments import UNDECIDED_CALL, Segment, TextSegment, held_marker_prefix

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, final: bool) -> list[Segment]:
    segments: list[Segment] = []
    pos = 0
    while True:
        start = text.find(HERMES_START, pos)
        if start < 0:
            rest = text[pos:]
            held = 0 if final else held_marker_prefix(rest, (HERMES_START,))
            segments.append(TextSegment(rest[:len(rest) - held]))
            return segments
        segments.append(TextSegment(text[pos:start]))
        body = skip_whitespace(text, start + len(HERMES_START))
        try:
            if body >= len(text):
                if final:
                    raise Malformed
                return [*segments, UNDECIDED_CALL]
            call, end = scan_call(text, body)
            if end is None:
                if final:
                    raise Malformed
                return [*segments, call]
        except Malformed:
            # Not a call: the block, markers and all, is text once it is closed (or the reply ends).
            close = text.find(HERMES_END, start)
            if close < 0:
                return [*segments, TextSegment(text[start:]) if final else UNDECIDED_CALL]
            pos = close + len(HERMES_END)
            segments.append(TextSegment(text[start:pos]))
            continue
        segments.append(call)
        after = skip_whitespace(text, end)
        if text.startswith(HERMES_END, after):
            pos = after + len(HERMES_END)
        elif not final and HERMES_END.startswith(text[after:]):
            return segments  # the end marker may still come
        else:
            pos = end  # no end marker: the call stands, and what follows it is text
