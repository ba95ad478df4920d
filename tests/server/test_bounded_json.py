"""The body decoder's bounds: each hostile shape is a BodyJSONError naming its rule, never a
RecursionError or ValueError escaping; everything JSON allows within the bounds decodes as
json.loads would."""

from __future__ import annotations

import json
import sys

import pytest

from kvserve.server.bounded_json import MAX_DEPTH, BodyJSONError, decode_json, nesting_depth


def code_of(raw: bytes) -> str:
    with pytest.raises(BodyJSONError) as caught:
        decode_json(raw)
    return caught.value.code


@pytest.mark.parametrize("opener,closer,core", [("[", "]", ""), ('{"a":', "}", "1")])
def test_nesting_up_to_the_limit_decodes_and_beyond_it_is_refused(opener: str, closer: str, core: str) -> None:
    at_limit = opener * MAX_DEPTH + core + closer * MAX_DEPTH
    assert decode_json(at_limit.encode()) == json.loads(at_limit)
    for depth in (MAX_DEPTH + 1, 900, 20_000):  # 20,000: beyond the decoder's own recursion limit
        assert code_of((opener * depth + core + closer * depth).encode()) == "json_too_deep"
    assert str(MAX_DEPTH) in str(pytest.raises(BodyJSONError, decode_json, (opener * 999 + core + closer * 999).encode()).value)


def test_brackets_inside_strings_are_not_nesting() -> None:
    text = json.dumps({"prompt": "[" * 5000 + "{" * 5000, "stop": ["]]]"]})
    assert decode_json(text.encode()) == json.loads(text)


def test_nesting_depth_counts_arrays_and_objects() -> None:
    assert [nesting_depth(v) for v in (1, "s", [], {}, [1, [2]], {"a": [{"b": []}]}, [[], [[[]]]])] == [0, 0, 1, 1, 2, 4, 4]


def test_integers_past_pythons_digit_limit_are_refused_naming_it() -> None:
    limit = sys.get_int_max_str_digits()
    assert decode_json(b'{"n": ' + b"9" * limit + b"}") == {"n": int("9" * limit)}
    with pytest.raises(BodyJSONError, match=str(limit)) as caught:
        decode_json(b'{"n": -' + b"9" * (limit + 1) + b"}")
    assert caught.value.code == "number_too_long"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(constant: str) -> None:
    assert code_of(f'{{"temperature": {constant}}}'.encode()) == "invalid_json"


@pytest.mark.parametrize("text", ['"\\ud800"', '"a\\udfffb"', '"\\udc00\\ud800"', '{"\\ud800": 1}'])
def test_unpaired_surrogate_escapes_are_refused(text: str) -> None:
    with pytest.raises(BodyJSONError, match="surrogate") as caught:
        decode_json(text.encode())
    assert caught.value.code == "invalid_json"


@pytest.mark.parametrize("text", ['"\\ud83d\\ude00"', '"\\\\ud800"', '"\\u00e9\\u0000"'])
def test_paired_and_escaped_backslash_forms_decode(text: str) -> None:
    assert decode_json(text.encode()) == json.loads(text)


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
def test_the_encodings_json_allows_decode(encoding: str) -> None:
    body = {"prompt": "caf\u00e9 \U0001f600", "n": [1, 2.5, None, True]}
    assert decode_json(json.dumps(body, ensure_ascii=False).encode(encoding)) == body


@pytest.mark.parametrize("raw", [b'{"a": "\xff"}', b'{"a": "\xc0\xaf"}', b'{"a": "\xed\xa0\x80"}',
                                 b'{"a": "caf\xe9"}', b'{"a": "x\x01"}', b'{"a": ', b""])
def test_bytes_that_are_not_json_text_are_invalid_json(raw: bytes) -> None:
    assert code_of(raw) == "invalid_json"
