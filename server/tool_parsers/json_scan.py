"""A forgiving JSON skimmer for tool calls that are still being generated.

`json.loads` answers only for complete text; a streamed tool call must be read while it grows.
The skimmer walks a JSON value and says where it ends, or raises `Incomplete` when the text
stops inside it (more tokens may finish it) or `Malformed` when no continuation can make it JSON.
Malformed is decided by a prefix, so text that was malformed stays malformed as it grows: a
streamed call can only go from "undecided" to "call" or to "text", never back.

`scan_call` reads one call object, {"name": "...", "arguments" | "parameters": {...}}, and
reports its name once that string is complete and the raw text of its arguments so far. The raw
text (not a re-serialisation) is what the client gets, so the fragments streamed while a call is
generated concatenate to exactly the arguments of the finished call.
"""

from __future__ import annotations

import json
import re

from kvserve.server.tool_parsers.segments import CallSegment

_WHITESPACE = " \t\n\r"
_NUMBER_CHARS = "0123456789+-.eE"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")
_scan_string = json.decoder.scanstring
# Deeper nesting than any tool's arguments need; it bounds the recursion on hostile output.
_MAX_DEPTH = 64
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Mistral say arguments, Llama-3 parameters


class Incomplete(Exception):
    """The text ends inside the value."""


class Malformed(Exception):
    """The text is not (the start of) JSON of the expected shape."""


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def value_end(text: str, pos: int, depth: int = 0) -> int:
    """The index just after the JSON value that starts at `pos`."""
    if pos >= len(text):
        raise Incomplete
    if depth > _MAX_DEPTH:
        raise Malformed
    first = text[pos]
    if first == '"':
        return string_end(text, pos)
    if first in "{[":
        return _container_end(text, pos, depth)
    if first in _NUMBER_CHARS:
        end = pos
        while end < len(text) and text[end] in _NUMBER_CHARS:
            end += 1
        if end == len(text):  # more digits may follow
            raise Incomplete
        if not _NUMBER.fullmatch(text, pos, end):
            raise Malformed
        return end
    for literal in _LITERALS:
        if text.startswith(literal, pos):
            return pos + len(literal)
        if literal.startswith(text[pos:]):
            raise Incomplete
    raise Malformed


def string_end(text: str, pos: int) -> int:
    """The index just after the string whose opening quote is at `pos`."""
    search = pos + 1
    while True:
        quote = text.find('"', search)
        if quote < 0:
            raise Incomplete
        backslashes = 0
        while text[quote - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            return quote + 1
        search = quote + 1


def _container_end(text: str, pos: int, depth: int) -> int:
    is_object = text[pos] == "{"
    close = "}" if is_object else "]"
    pos = _after_whitespace(text, pos + 1)
    if text[pos] == close:
        return pos + 1
    while True:
        if is_object:
            pos = _after_key(text, pos)
        pos = _after_whitespace(text, value_end(text, pos, depth + 1))
        if text[pos] == close:
            return pos + 1
        if text[pos] != ",":
            raise Malformed
        pos = _after_whitespace(text, pos + 1)


def _after_whitespace(text: str, pos: int) -> int:
    """The next non-blank position, which must exist."""
    pos = skip_whitespace(text, pos)
    if pos >= len(text):
        raise Incomplete
    return pos


def _after_key(text: str, pos: int) -> int:
    """Past `"key":` and the blanks after it."""
    if text[pos] != '"':
        raise Malformed
    pos = _after_whitespace(text, string_end(text, pos))
    if text[pos] != ":":
        raise Malformed
    return _after_whitespace(text, pos + 1)


def scan_call(text: str, pos: int) -> tuple[CallSegment, int | None]:
    """The call object starting at `pos` (its `{`) and the index after it, or None as the end
    while the text stops inside it. Raises Malformed for anything that is not a call: not an
    object, a name that is not a non-empty string, arguments that are not an object, or a
    finished object without both."""
    if text[pos] != "{":
        raise Malformed
    name: str | None = None
    arguments: tuple[int, int | None] | None = None  # (start, end) of the raw arguments
    try:
        pos = _after_whitespace(text, pos + 1)
        if text[pos] == "}":
            raise Malformed
        while True:
            key_start = pos
            pos = _after_key(text, pos)
            key = _string_value(text, key_start)
            if key == "name" and name is None:
                if text[pos] != '"':
                    raise Malformed
                end = string_end(text, pos)
                name = _string_value(text, pos)
                if not name:
                    raise Malformed
            elif key in ARGUMENT_KEYS and arguments is None:
                if text[pos] != "{":
                    raise Malformed
                arguments = (pos, None)
                end = value_end(text, pos)
                arguments = (pos, end)
            else:
                end = value_end(text, pos)
            pos = _after_whitespace(text, end)
            if text[pos] == "}":
                break
            if text[pos] != ",":
                raise Malformed
            pos = _after_whitespace(text, pos + 1)
    except Incomplete:
        raw = "" if arguments is None else text[arguments[0]:arguments[1]]
        return CallSegment(name, raw, complete=False), None
    if name is None or arguments is None:
        raise Malformed
    raw = text[arguments[0]:arguments[1]]
    try:
        json.loads(raw, strict=False)
    except json.JSONDecodeError:  # the skimmer is lenient where JSON is not (e.g. bad escapes)
        raise Malformed from None
    return CallSegment(name, raw, complete=True), pos + 1


def _string_value(text: str, pos: int) -> str:
    """The complete string whose opening quote is at `pos`, unescaped."""
    string_end(text, pos)  # raises Incomplete while the closing quote is missing
    try:
        value, _ = _scan_string(text, pos + 1, False)  # the C scanner: this runs for every key
    except json.JSONDecodeError:  # a bad escape
        raise Malformed from None
    return value


def scan_call_array(text: str, pos: int) -> tuple[list[CallSegment], int | None]:
    """A JSON array of call objects starting at `pos` (its `[`): the calls so far and the index
    after the array, or None as the end while the text stops inside it."""
    if text[pos] != "[":
        raise Malformed
    calls: list[CallSegment] = []
    pos = skip_whitespace(text, pos + 1)
    while True:
        if pos >= len(text):
            return calls, None
        call, end = scan_call(text, pos)
        calls.append(call)
        if end is None:
            return calls, None
        pos = skip_whitespace(text, end)
        if pos >= len(text):
            return calls, None
        if text[pos] == "]":
            return calls, pos + 1
        if text[pos] != ",":
            raise Malformed
        pos = skip_whitespace(text, pos + 1)
