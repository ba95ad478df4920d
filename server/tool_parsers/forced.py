"""Parsers for forced calls (tool_choice "required" or a named function), whose shape the
grammar engine guarantees; only a reply cut short (max_tokens) fails to parse, and stays text.

    named function   the arguments object itself (the name is known from the request)
    required         [{"name": ..., "parameters": {...}}, ...]
"""

from __future__ import annotations

from kvserve.server.tool_parsers.json_scan import (Incomplete, Malformed, scan_call_array, skip_whitespace,
                                                   value_end)
from kvserve.server.tool_parsers.segments import CallSegment, OutputParser, Segment, TextSegment


def named_call_parser(name: str) -> OutputParser:
    def parse(text: str, final: bool) -> list[Segment]:
        start = skip_whitespace(text, 0)
        if start >= len(text):
            return [TextSegment(text)] if final else []
        try:
            if text[start] != "{":
                raise Malformed
            end = value_end(text, start)
        except Incomplete:
            return [TextSegment(text)] if final else [CallSegment(name, text[start:], complete=False)]
        except Malformed:
            return [TextSegment(text)]
        return [CallSegment(name, text[start:end], complete=True), TextSegment(text[end:])]

    return parse


def parse_required(text: str, final: bool) -> list[Segment]:
    start = skip_whitespace(text, 0)
    if start >= len(text):
        return [TextSegment(text)] if final else []
    try:
        calls, end = scan_call_array(text, start)
        if end is None and final:
            raise Malformed
    except Malformed:
        return [TextSegment(text)]
    if end is None:
        return list(calls)
    return [*calls, TextSegment(text[end:])]
