"""The tool-call parsers (issue 13, tool_choice "auto"): each family's typical output becomes
calls plus the text around them; text that only looks like a call stays content; and a reply
streamed in any cut reassembles to exactly the non-streamed message, with no marker text in the
streamed content."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.server.tool_parsers import (TOOL_CALL_PARSERS, ParsedCall, ParsedMessage, ToolCallStream,
                                         named_call_parser, parse_required, parsed_message)
from kvserve.server.tool_parsers.json_scan import Incomplete, Malformed, value_end

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"q": "a \\"quoted\\" } brace", "n": [1, -2.5e3, true, null], "o": {"k": {}}}'


def parse(family: str, text: str) -> ParsedMessage:
    return parsed_message(TOOL_CALL_PARSERS[family](text, True))


def calls(*pairs: tuple[str, str]) -> list[ParsedCall]:
    return [ParsedCall(name, arguments) for name, arguments in pairs]


# ------------------------------------------------------------------------------ typical outputs

TYPICAL = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, calls(("get_weather", WEATHER))),
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "a", "arguments": {WEATHER}}}\n</tool_call>\n'
               f'<tool_call>{{"arguments": {NESTED}, "name": "b"}}</tool_call>\n',
     "Let me check.", calls(("a", WEATHER), ("b", NESTED))),
    ("hermes", f'<tool_call>{{"name": "a", "arguments": {{}}}}</tool_call>Done.', "Done.", calls(("a", "{}"))),
    # The model stopped (EOS) before writing the end marker: the call stands.
    ("hermes", f'<tool_call>{{"name": "a", "arguments": {WEATHER}}}', None, calls(("a", WEATHER))),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, calls(("get_weather", WEATHER))),
    ("llama3_json", f'<|python_tag|>{{"name": "a", "parameters": {WEATHER}}}; {{"name": "b", "arguments": {NESTED}}}',
     None, calls(("a", WEATHER), ("b", NESTED))),
    ("llama3_json", f' {{"name": "a", "parameters": {{}}}}\nI called a.', "\nI called a.", calls(("a", "{}"))),
    # Llama 3.x often writes a few words first; several calls are separated by semicolons.
    ("llama3_json", f'Sure! {{"name": "get_weather", "parameters": {WEATHER}}}', "Sure!",
     calls(("get_weather", WEATHER))),
    ("llama3_json", f'Sure! <|python_tag|>{{"name": "a", "parameters": {WEATHER}}}; '
                    f'{{"name": "b", "parameters": {NESTED}}}', "Sure!", calls(("a", WEATHER), ("b", NESTED))),
    ("llama3_json", '{"name": "a", "parameters": {}};{"name": "b", "parameters": {}};', None,
     calls(("a", "{}"), ("b", "{}"))),
    ("llama3_json", f'Checking.\n{{"name": "a", "parameters": {WEATHER}}}\n{{"name": "b", "arguments": {{}}}}\nDone.',
     "Checking.\nDone.", calls(("a", WEATHER), ("b", "{}"))),
    # JSON that is not a call is text, and the search for calls goes on after it.
    ("llama3_json", f'Here: {{"city": "Paris"}} and {{"name": "a", "parameters": {{}}}}', 'Here: {"city": "Paris"} and',
     calls(("a", "{}"))),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]', None,
     calls(("get_weather", WEATHER))),
    ("mistral", f'Sure. [TOOL_CALLS] [{{"name": "a", "arguments": {WEATHER}}}, {{"name": "b", "arguments": {NESTED}}}]',
     "Sure.", calls(("a", WEATHER), ("b", NESTED))),
    # [TOOL_CALLS] is a control token: with special tokens skipped the reply is the bare array.
    ("mistral", f'[{{"name": "a", "arguments": {WEATHER}}}]', None, calls(("a", WEATHER))),
    ("mistral", f'[TOOL_CALLS]{{"name": "a", "arguments": {WEATHER}}}', None, calls(("a", WEATHER))),
    # Tokenizer v11+: [TOOL_CALLS]name[ARGS]{...} per call.
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{WEATHER}', None, calls(("get_weather", WEATHER))),
    ("mistral", f'Sure.[TOOL_CALLS]a[ARGS]{WEATHER}[TOOL_CALLS]b[ARGS]{NESTED}', "Sure.",
     calls(("a", WEATHER), ("b", NESTED))),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', None,
     calls(("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}'))),
    ("mistral", f'[TOOL_CALLS]get-weather_2[ARGS]{WEATHER}\nDone.', "\nDone.", calls(("get-weather_2", WEATHER))),
    ("mistral", f'[TOOL_CALLS]a[CALL_ID]x1Y2z3W4v[ARGS]{WEATHER}[TOOL_CALLS]b[CALL_ID]k9[ARGS]{{}}', None,
     calls(("a", WEATHER), ("b", "{}"))),
    # ... and with special tokens skipped ([TOOL_CALLS] and [ARGS] gone), calls that open the reply.
    ("mistral", f'get_weather{WEATHER}', None, calls(("get_weather", WEATHER))),
    ("mistral", f'a{WEATHER}b{NESTED}', None, calls(("a", WEATHER), ("b", NESTED))),
    ("mistral", f'a{WEATHER} b{{}} That is all.', " That is all.", calls(("a", WEATHER), ("b", "{}"))),
]

# Text that looks like a call but is not one stays content, whole.
NOT_CALLS = [
    ("hermes", "Plain answer, no tools."),
    ("hermes", "<tool_call>not json</tool_call> and more"),
    ("hermes", '<tool_call>{"name": "a"}</tool_call>'),  # no arguments
    ("hermes", '<tool_call>{"name": "a", "arguments": "{}"}</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>{"name": "", "arguments": {}}</tool_call>'),
    ("hermes", "I would write </tool_call> here"),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but no call
    ("llama3_json", '<|python_tag|>print("hi")'),
    ("llama3_json", '{"data": {"name": "a", "parameters": {}}}'),  # call-shaped data inside JSON
    ("llama3_json", 'Code: f() { return 1; } {"name": "a", "parameters": {}}'),  # text that is not JSON ends the calls
    ("llama3_json", "Sets like {1, 2} and <|python_tag|>"),
    ("mistral", "[1, 2, 3] are numbers"),
    ("mistral", '[TOOL_CALLS]'),
    ("mistral", "[TOOL"),
    ("mistral", "Hello"),
    ("mistral", "Hello world, no tools."),
    ("mistral", "Sure{ that is it }"),
    ("mistral", "a[ARGS]"),
    ("mistral", "[TOOL_CALLS]a[ARGS]not json"),
    ("mistral", '[TOOL_CALLS]bad name{"x": 1}'),
    ("mistral", '[TOOL_CALLS]a[CALL_ID]x y[ARGS]{"x": 1}'),
    ("mistral", '[TOOL_CALLS]a[CALL_ID]xy{"x": 1}'),  # [ARGS] must follow the id
    ("mistral", 'Text first, then a{"x": 1}'),  # without markers only a reply that opens with calls has them
]


# Calls that break after their name and the start of their arguments were streamed (cut off by
# max_tokens, or broken JSON): non-streamed they are content; streamed, what was sent stands.
BROKEN_AFTER_START = [
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1', '{"x": '),
    ("llama3_json", '{"name": "a", "parameters": {"x": tru}}', '{"x": tru'),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, oops]', "{}"),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1', '{"x": '),
    ("mistral", 'a{"x": tru}', '{"x": tru'),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": "\\q"}', '{"x": "\\q"'),  # a bad escape: not JSON
    ("llama3_json", '{"name": "a", "parameters": {}', "{"),  # cut off: the final "}" is not streamed
]


@pytest.mark.parametrize(("family", "text", "content", "expected"), TYPICAL)
def test_typical_outputs(family, text, content, expected):
    message = parse(family, text)
    assert message == ParsedMessage(content, expected)
    for call in message.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("family", "text"), NOT_CALLS + [(f, t) for f, t, _ in BROKEN_AFTER_START])
def test_text_that_is_not_a_call_stays_content(family, text):
    assert parse(family, text) == ParsedMessage(text, [])


def test_malformed_block_between_calls_stays_content_and_the_calls_stand():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{bad}</tool_call> '
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    assert parse("hermes", text) == ParsedMessage(" <tool_call>{bad}</tool_call>", calls(("a", "{}"), ("b", '{"x": 1}')))


def test_forced_outputs():
    named = named_call_parser("get_weather")
    assert parsed_message(named(f" {WEATHER}", True)) == ParsedMessage(None, calls(("get_weather", WEATHER)))
    assert parsed_message(named('{"city": "Par', True)) == ParsedMessage('{"city": "Par', [])
    required = f'[{{"name": "a", "parameters": {WEATHER}}}, {{"name": "b", "parameters": {{}}}}]'
    assert parsed_message(parse_required(required, True)) == ParsedMessage(None, calls(("a", WEATHER), ("b", "{}")))
    assert parsed_message(parse_required(required[:-3], True)) == ParsedMessage(required[:-3], [])


@pytest.mark.parametrize(("text", "end"), [('"a\\"b" x', 6), ("-1.5e3,", 6), ("true]", 4), ('{"a": [1, {}]} ', 14),
                                           ("[]", 2)])
def test_value_end(text, end):
    assert value_end(text, 0) == end


@pytest.mark.parametrize("text", ['"abc', "12", "tr", '{"a": 1', '{"a"', "[1,"])
def test_value_end_incomplete(text):
    with pytest.raises(Incomplete):
        value_end(text, 0)


@pytest.mark.parametrize("text", ["x", "1.2.3,", "trux", '{"a" 1}', "{1: 2}", "[1 2]", "[" * 100 + "]" * 100])
def test_value_end_malformed(text):
    with pytest.raises(Malformed):
        value_end(text, 0)


# ---------------------------------------------------------------------------------- streaming

def stream(parser, text: str, cuts: list[int]) -> tuple[str, dict[int, dict], bool, list[dict]]:
    """Feeds `text` cut at `cuts`; returns the streamed content, the calls reassembled as a
    client does, whether the last delta reported calls, and every tool-call delta entry."""
    tool_stream = ToolCallStream(parser)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, assembled, entries, has_calls = "", {}, [], False
    for i, piece in enumerate(pieces):
        delta = tool_stream.feed(piece, final=i == len(pieces) - 1)
        content += delta.content
        has_calls = delta.has_calls
        for entry in delta.tool_calls:
            entries.append(entry)
            call = assembled.setdefault(entry["index"], {"name": None, "arguments": ""})
            if "id" in entry:
                assert call["name"] is None, "a call is announced once"
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                assert entry["function"]["arguments"] == ""
                call["name"] = entry["function"]["name"]
            else:
                assert call["name"] is not None, "fragments come after the call's name"
                assert set(entry["function"]) == {"arguments"}
            call["arguments"] += entry["function"]["arguments"]
    return content, assembled, has_calls, entries


def random_cuts(text: str, rng: random.Random) -> list[int]:
    return sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []


FORCED = [(named_call_parser("f"), f" {NESTED}"), (named_call_parser("f"), "not json"),
          (parse_required, f'[{{"name": "a", "parameters": {WEATHER}}}, {{"name": "b", "parameters": {{}}}}]')]
ALL_OUTPUTS = ([(TOOL_CALL_PARSERS[f], text) for f, text, *_ in TYPICAL] +
               [(TOOL_CALL_PARSERS[f], text) for f, text in NOT_CALLS] + FORCED)


@pytest.mark.parametrize(("parser", "text"), ALL_OUTPUTS)
def test_streamed_deltas_reassemble_to_the_non_streamed_message(parser, text):
    expected = parsed_message(parser(text, True))
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), [], *(random_cuts(text, rng) for _ in range(20))]:
        content, assembled, has_calls, _ = stream(parser, text, cuts)
        assert (content or None) == expected.content
        assert [ParsedCall(c["name"], c["arguments"]) for _, c in sorted(assembled.items())] == expected.calls
        assert has_calls == bool(expected.calls)


@pytest.mark.parametrize(("family", "text"), [(f, t) for f, t, *_ in TYPICAL])
def test_marker_text_never_reaches_streamed_content(family, text):
    content, *_ = stream(TOOL_CALL_PARSERS[family], text, list(range(1, len(text))))
    for marker in ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", '"name"'):
        assert marker not in content


def test_arguments_stream_as_they_are_generated():
    text = f'Hi <tool_call>{{"name": "get_weather", "arguments": {WEATHER}}}</tool_call>'
    _, _, _, entries = stream(TOOL_CALL_PARSERS["hermes"], text, list(range(1, len(text))))
    fragments = [e["function"]["arguments"] for e in entries if "id" not in e]
    assert len(fragments) == len(WEATHER)  # one per character fed: nothing waits for the call's end


@pytest.mark.parametrize(("family", "text", "sent_arguments"), BROKEN_AFTER_START)
def test_a_call_that_breaks_after_it_was_announced_is_left_as_sent(family, text, sent_arguments):
    content, assembled, has_calls, _ = stream(TOOL_CALL_PARSERS[family], text, list(range(1, len(text))))
    assert assembled[0] == {"name": "a", "arguments": sent_arguments}
    assert content == "" and not has_calls  # finish_reason stays the engine's


# ------------------------------------------------------------------------- parallel_tool_calls

@pytest.mark.parametrize(("parser", "text"), ALL_OUTPUTS)
def test_without_parallel_calls_at_most_the_first_call_is_returned_streamed_or_not(parser, text):
    everything = parsed_message(parser(text, True))
    expected = parsed_message(parser(text, True), parallel_calls=False)
    assert expected.calls == everything.calls[:1] and expected.content == everything.content
    for cuts in [list(range(1, len(text))), random_cuts(text, random.Random(len(text)))]:
        tool_stream = ToolCallStream(parser, parallel_calls=False)
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        deltas = [tool_stream.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        entries = [entry for delta in deltas for entry in delta.tool_calls]
        assert {entry["index"] for entry in entries} <= {0}
        announced = [entry["function"]["name"] for entry in entries if "id" in entry]
        assert announced == [call.name for call in expected.calls]
        assert "".join(entry["function"]["arguments"] for entry in entries) == "".join(
            call.arguments for call in expected.calls)
        assert ("".join(d.content for d in deltas) or None) == expected.content
        assert deltas[-1].has_calls == bool(expected.calls)


def test_without_parallel_calls_the_text_around_a_dropped_call_stays_content():
    text = ('Both. <tool_call>{"name": "a", "arguments": {}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": {}}</tool_call> done')
    assert parsed_message(TOOL_CALL_PARSERS["hermes"](text, True), parallel_calls=False) == ParsedMessage(
        "Both. and done", calls(("a", "{}")))
