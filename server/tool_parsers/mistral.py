"""Mistral models open their calls with the [TOOL_CALLS] token, in one of two formats that
depend on the tokenizer version the model was trained with (vLLM picks one by the tokenizer;
this parser reads either, by the text after the marker):

    before v11 (Mistral 7B v0.3, Mixtral, Nemo)    Sure. [TOOL_CALLS][{"name": "a", "arguments": {...}}, ...]
    v11 and later (Mistral Small 3.1+, Devstral)   Sure. [TOOL_CALLS]a[ARGS]{...}[TOOL_CALLS]b[ARGS]{...}
                                                   (or a[CALL_ID]id[ARGS]{...}, as mistral-common decodes)

[TOOL_CALLS] and [ARGS] are control tokens: with special tokens skipped (the default) they
vanish, and the reply reads `[{"name": ...}]` or `a{...}b{...}`. Without the markers nothing
tells a call from text, so then only a reply that opens with calls has them (a bare JSON array
of calls, or name{...} pairs one after another); text before a call needs the markers
(`"skip_special_tokens": false` in the request, which is what vLLM sets for this parser).
Streamed, a reply's first word waits until the character after it shows it is no call name.

The text before, between and after calls is content. Unlike vLLM, which returns a v11 call
whose arguments are not JSON as a call anyway, such a call stays text.
"""

from __future__ import annotations

import json
import string

from kvserve.server.tool_parsers.json_scan import (Incomplete, Malformed, scan_call, scan_call_array,
                                                   skip_whitespace, value_end)
from kvserve.server.tool_parsers.segments import (UNDECIDED_CALL, CallSegment, Segment, TextSegment,
                                                  held_marker_prefix)

MISTRAL_MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"
CALL_ID_MARKER = "[CALL_ID]"  # mistral-common v11 with call ids: name[CALL_ID]id[ARGS]{...}
# OpenAI's alphabet for function names; the name ends where [ARGS] or the arguments' `{` begins.
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")


def parse_mistral(text: str, final: bool) -> list[Segment]:
    segments: list[Segment] = []
    text_from = 0  # the text from here on is not in a segment yet
    start = skip_whitespace(text, 0)
    if not text.startswith(MISTRAL_MARKER, start):
        if not final and MISTRAL_MARKER.startswith(text[start:]):
            return []  # nothing yet, or the start of the marker
        start = _bare_start(text, start)
    while start is not None:
        marked = text.startswith(MISTRAL_MARKER, start)
        body = skip_whitespace(text, start + len(MISTRAL_MARKER)) if marked else start
        before = TextSegment(text[text_from:start])
        try:
            calls, end = _calls_at(text, body, marked, final)
        except Malformed:
            # Not a call: this block, marker and all, is text up to the next marker.
            following = text.find(MISTRAL_MARKER, body)
            if following < 0:
                rest = text[start:]
                held = 0 if final else held_marker_prefix(rest, (MISTRAL_MARKER,))
                return [*segments, before, TextSegment(rest[:len(rest) - held])]
            segments += [before, TextSegment(text[start:following])]
            text_from = start = following
            continue
        if end is None:
            return [*segments, before, *calls]
        segments += [before, *calls]
        text_from = end
        following = text.find(MISTRAL_MARKER, end)
        start = following if following >= 0 else None
    rest = text[text_from:]
    held = 0 if final else held_marker_prefix(rest, (MISTRAL_MARKER,))
    return [*segments, TextSegment(rest[:len(rest) - held])]


def _bare_start(text: str, start: int) -> int | None:
    """Where the reply's calls begin when their markers were skipped: a reply that opens with
    a JSON array or a name (both are checked as calls), else the first marker later on."""
    if start < len(text) and (text[start] == "[" or text[start] in _NAME_CHARS):
        return start
    following = text.find(MISTRAL_MARKER, start)
    return following if following >= 0 else None


def _calls_at(text: str, body: int, marked: bool, final: bool) -> tuple[list[Segment], int | None]:
    """The calls that begin at `body`, and where they end (None: not yet known, the last call
    or an undecided block is still being written). Raises Malformed when they are not calls.

    After a marker: a JSON array of calls, one call object, or one name[ARGS]{...} call.
    Without one (the markers were skipped): a JSON array, or name{...} calls one after another."""
    if body >= len(text):
        if final:
            raise Malformed
        return [UNDECIDED_CALL], None
    if text[body] == "[":
        array, end = scan_call_array(text, body)
        if end is None and final:
            raise Malformed
        return [*array] if array else [UNDECIDED_CALL], end
    if text[body] == "{" and marked:
        call, call_end = scan_call(text, body)
        if call_end is None and final:
            raise Malformed
        return [call], call_end
    calls: list[Segment] = []
    end = pos = body
    while True:
        try:
            call, call_end = _scan_named_call(text, pos)
        except Malformed:
            if not calls:
                raise
            return calls, end  # what follows the calls is text
        if call_end is None:
            if not final:
                return [*calls, call], None
            if not calls:
                raise Malformed
            return calls, end  # cut off: the calls before it stand, the rest is text
        calls.append(call)
        end = call_end
        if marked:
            return calls, end  # each call has its own marker
        pos = skip_whitespace(text, end)
        if pos >= len(text):
            return (calls, end) if final else ([*calls, UNDECIDED_CALL], None)  # another call may follow


def _scan_named_call(text: str, pos: int) -> tuple[CallSegment, int | None]:
    """name[ARGS]{...} or name[CALL_ID]id[ARGS]{...} (v11+; the markers are absent when special
    tokens are skipped) at `pos`: the call and the index after it, or None while it is still
    being written. The model's own call id is not kept: the server gives every call its id."""
    name_end = pos
    while name_end < len(text) and text[name_end] in _NAME_CHARS:
        name_end += 1
    if name_end == pos:
        raise Malformed
    if name_end == len(text):
        return UNDECIDED_CALL, None  # the name may go on
    name = text[pos:name_end]
    arguments = name_end
    if text.startswith(CALL_ID_MARKER, arguments):
        arguments += len(CALL_ID_MARKER)
        while arguments < len(text) and text[arguments].isalnum():
            arguments += 1
        if not text.startswith(ARGS_MARKER, arguments):
            if ARGS_MARKER.startswith(text[arguments:]):
                return CallSegment(name, "", complete=False), None  # the id, or [ARGS], goes on
            raise Malformed
    elif any(m.startswith(text[arguments:]) for m in (ARGS_MARKER, CALL_ID_MARKER)):
        return UNDECIDED_CALL, None  # the start of a marker
    if text.startswith(ARGS_MARKER, arguments):
        arguments += len(ARGS_MARKER)
    if arguments == len(text):
        return CallSegment(name, "", complete=False), None
    if text[arguments] != "{":
        raise Malformed
    try:
        end = value_end(text, arguments)
    except Incomplete:
        # Announced only once the object's first key begins: prose such as "Sure{ that" is
        # found to be no call before anything is sent (a name is any word here).
        raw = text[arguments:]
        return CallSegment(name, raw if raw[1:].strip() else "", complete=False), None
    raw = text[arguments:end]
    try:
        json.loads(raw, strict=False)
    except json.JSONDecodeError:  # the skimmer is lenient where JSON is not (e.g. bad escapes)
        raise Malformed from None
    return CallSegment(name, raw, complete=True), end
