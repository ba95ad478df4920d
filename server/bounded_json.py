"""Decodes a request body as JSON within bounds, so that no body can make the server fail:

- nesting at most `MAX_DEPTH` arrays/objects deep (Python's decoder dies of RecursionError near
  a thousand, and code that walks the value afterwards may recurse too);
- integers of at most Python's `sys.get_int_max_str_digits()` digits (4,300 by default: beyond
  it the decoder raises ValueError, a guard against quadratic conversion; no field means
  anything near it, and the fields' own ranges refuse what is merely large);
- valid Unicode only: a `\\ud800` escape without its pair decodes to a lone surrogate that the
  tokenizer, the prefix-cache hash and UTF-8 output all fail on;
- JSON's own grammar: `NaN` and `Infinity`, which Python's decoder accepts, are not JSON.

Each check costs little next to the parse: the depth walk visits containers' items, never the
characters of strings, and only a body with a `\\ud8..`-`\\udf..` escape is checked for pairs.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

MAX_DEPTH = 128

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_CONTAINERS = (dict, list)  # what json.loads makes arrays and objects into


class BodyJSONError(ValueError):
    """The body is not JSON the server accepts; `code` says which rule it broke."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def decode_json(raw: bytes) -> Any:
    try:
        text = raw.decode(json.detect_encoding(raw))  # UTF-8 (a BOM allowed), -16 or -32, strictly
    except UnicodeDecodeError as error:
        raise BodyJSONError(f"The request body is not valid JSON: {error}", "invalid_json") from None
    try:
        value = json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as error:
        raise BodyJSONError(f"The request body is not valid JSON: {error}", "invalid_json") from None
    except BodyJSONError:
        raise
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # an integer beyond Python's conversion limit
        raise BodyJSONError(f"The request body has an integer of more than {sys.get_int_max_str_digits()} "
                            "digits, the server's limit.", "number_too_long") from None
    # Fewer brackets in the whole text (strings included) than the limit: no need to walk.
    if text.count("[") + text.count("{") > MAX_DEPTH and nesting_depth(value) > MAX_DEPTH:
        raise _too_deep()
    if _SURROGATE_ESCAPE.search(text):  # maybe a proper pair (an escaped emoji); look closer
        _check_unicode(value)
    return value


def nesting_depth(value: Any) -> int:
    """How deep arrays and objects nest in a decoded value (a scalar: 0), level by level without
    recursion; stops counting once past MAX_DEPTH."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level and depth <= MAX_DEPTH:
        depth += 1
        inner: list[Any] = []
        for node in level:
            inner += [child for child in (node.values() if type(node) is dict else node) if type(child) in _CONTAINERS]
        level = inner
    return depth


def _check_unicode(value: Any) -> None:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        char = error.object[error.start]
        raise BodyJSONError(f"The request body is not valid JSON text: a string holds the unpaired UTF-16 "
                            f"surrogate \\u{ord(char):04x}; escape a character outside the Basic Multilingual "
                            "Plane as a surrogate pair, or send it as UTF-8.", "invalid_json") from None


def _not_json(constant: str) -> Any:
    raise BodyJSONError(f"The request body is not valid JSON: {constant} is not a JSON number.", "invalid_json")


def _too_deep() -> BodyJSONError:
    return BodyJSONError(f"The request body nests arrays and objects more than {MAX_DEPTH} deep, the server's "
                         "limit.", "json_too_deep")
