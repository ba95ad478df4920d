"""Per-family parsers for tool_choice "auto": how each model family writes a call in free text.

    hermes        Hermes 2 Pro, Qwen 2.5/3:  text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json   Llama 3.1-3.3:             [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]
                                             (the call must open the reply, as the model is trained to)
    mistral       Mistral / Mixtral:         text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

Markers that are control tokens vanish from the text when special tokens are skipped (the
default): Llama-3's <|python_tag|> and Mistral's [TOOL_CALLS]. So a reply that opens with the
bare JSON (object, or for Mistral an array of objects) is read as calls too. Anything that does
not parse as a call stays text, markers included.
"""

from __future__ import annotations

from kvserve.server.tool_parsers.json_scan import Malformed, scan_call, scan_call_array, skip_whitespace
from kvserve.server.tool_parsers.segments import CallSegment, OutputParser, Segment, TextSegment, held_marker_prefix

_UNDECIDED = CallSegment(None, "", complete=False)  # a block whose shape is not known yet

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
                return [*segments, _UNDECIDED]
            call, end = scan_call(text, body)
            if end is None:
                if final:
                    raise Malformed
                return [*segments, call]
        except Malformed:
            # Not a call: the block, markers and all, is text once it is closed (or the reply ends).
            close = text.find(HERMES_END, start)
            if close < 0:
                return [*segments, TextSegment(text[start:]) if final else _UNDECIDED]
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


LLAMA3_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, final: bool) -> list[Segment]:
    pos = skip_whitespace(text, 0)
    if text.startswith(LLAMA3_TAG, pos):
        pos = skip_whitespace(text, pos + len(LLAMA3_TAG))
    elif not final and LLAMA3_TAG.startswith(text[pos:]):
        return []  # nothing yet, or the start of the tag
    if pos >= len(text) or text[pos] != "{":
        return [] if not final and pos >= len(text) else [TextSegment(text)]
    calls: list[Segment] = []
    tail = 0  # where the text after the last finished call starts
    while True:
        try:
            call, end = scan_call(text, pos)
            if end is None and final:
                raise Malformed
        except Malformed:
            return [*calls, TextSegment(text[tail:])] if calls else [TextSegment(text)]
        if end is None:
            return [*calls, call]
        calls.append(call)
        tail = end
        after = skip_whitespace(text, end)
        if after >= len(text):
            return calls if not final else [*calls, TextSegment(text[end:])]
        if text[after] != ";":  # calls are separated by semicolons; anything else ends them
            return [*calls, TextSegment(text[end:])]
        pos = skip_whitespace(text, after + 1)
        if pos >= len(text):
            return calls if not final else [*calls, TextSegment(text[end:])]
        if text[pos] != "{":
            return [*calls, TextSegment(text[end:])]


MISTRAL_MARKER = "[TOOL_CALLS]"


def parse_mistral(text: str, final: bool) -> list[Segment]:
    start = text.find(MISTRAL_MARKER)
    if start >= 0:
        body = skip_whitespace(text, start + len(MISTRAL_MARKER))
    else:
        body = start = skip_whitespace(text, 0)
        bare_array = text.startswith("[", start) and not MISTRAL_MARKER.startswith(text[start:])
        if not bare_array:
            held = 0 if final else held_marker_prefix(text, (MISTRAL_MARKER,))
            return [TextSegment(text[:len(text) - held])]
    before = TextSegment(text[:start])
    try:
        if body >= len(text):
            if final:
                raise Malformed
            return [before, _UNDECIDED]
        if text[body] == "{":  # a single object, as some Mistral versions write it
            call, end = scan_call(text, body)
            calls = [call]
        else:
            calls, end = scan_call_array(text, body)
        if end is None:
            if final:
                raise Malformed
            return [before, *calls] if calls else [before, _UNDECIDED]
    except Malformed:
        return [before, TextSegment(text[start:])]
    return [before, *calls, TextSegment(text[end:])]


# vLLM's --tool-call-parser names.
TOOL_CALL_PARSERS: dict[str, OutputParser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
