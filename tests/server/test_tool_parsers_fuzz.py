"""Model output the parsers were not written for (issue 13): random mixes of call markers, JSON
pieces and prose never raise, every call they return has a name and a JSON object as arguments,
and a reply streamed in random cuts gives the non-streamed message whenever no call broke after
it was announced (the one case where the streamed deltas cannot be taken back)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.server.tool_parsers import (TOOL_CALL_PARSERS, OutputParser, ParsedCall, ToolCallStream,
                                         named_call_parser, parse_required, parsed_message)

FRAGMENTS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", "[", "]", ":", ",",
             ";", " ", "\n", '"', "\\", '"name"', '"arguments"', '"parameters"', '"a"', '"x"', "a", "get_weather",
             "1", "-2.5e3", "true", "nul", "{}", '"\\u00e9"', "Sure!", "é"]
# Whole calls in each family's format, drawn as often as all fragments together: the mixes hold
# calls between text, blanks and broken pieces.
CALLS = ['{"name": "a", "arguments": {"x": 1}}', '{"parameters": {}, "name": "b"}', '[{"name": "a", "arguments": {}}]',
         'get_weather{"x": [1]}', '<tool_call>{"name": "a", "arguments": {}}</tool_call>', '[TOOL_CALLS]a[ARGS]{}',
         '[TOOL_CALLS][{"name": "b", "arguments": {"y": "z"}}]', '[TOOL_CALLS]c[CALL_ID]a1b2[ARGS]{"k": null}']
PARSERS: list[OutputParser] = [*TOOL_CALL_PARSERS.values(), named_call_parser("f"), parse_required]

outputs = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.sampled_from(CALLS)), max_size=16).map("".join)


def streamed(parser: OutputParser, text: str, cuts: list[int],
             parallel: bool) -> tuple[str | None, list[ParsedCall], bool]:
    stream = ToolCallStream(parser, parallel_calls=parallel)
    bounds = sorted({c for c in cuts if 0 < c < len(text)})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    content, calls, has_calls = "", {}, False
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta.content
        has_calls = delta.has_calls
        for entry in delta.tool_calls:
            if "id" in entry:
                calls[entry["index"]] = [entry["function"]["name"], ""]
            calls[entry["index"]][1] += entry["function"]["arguments"]
    return content or None, [ParsedCall(*calls[i]) for i in sorted(calls)], has_calls


@pytest.mark.parametrize("parser", PARSERS, ids=[*TOOL_CALL_PARSERS, "named", "required"])
@settings(max_examples=300, deadline=None)
@given(text=outputs, cuts=st.lists(st.integers(0, 400), max_size=12), parallel=st.booleans())
def test_any_output_parses_without_error_and_streams_consistently(parser, text, cuts, parallel):
    expected = parsed_message(parser(text, True), parallel)
    for call in expected.calls:
        assert call.name and isinstance(json.loads(call.arguments, strict=False), dict)
    content, calls, has_calls = streamed(parser, text, cuts, parallel)
    if calls == expected.calls:
        assert content == expected.content
        assert has_calls == bool(expected.calls)
