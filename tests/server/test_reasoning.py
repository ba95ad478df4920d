"""--reasoning-parser: the thinking is split from the answer, streamed in any cut it adds up to
the non-streamed split, tool calls are read from the answer only, and output grammars let the
model think before they apply."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import xgrammar as xgr

from kvserve.engine import GrammarKind, StructuredOutputParams
from kvserve.server.app import build_app
from kvserve.server.reasoning import REASONING_PARSERS, ReasoningSplitter, split_reasoning
from kvserve.server.reasoning_grammar import after_reasoning
from kvserve.server.settings import ServerSettings
from kvserve.server.structured_outputs import OutputConstraint
from tests.server.scripted_engine import ScriptedEngine
from tests.server.sse import parse_sse

# (text, starts open, reasoning, content)
SPLITS = [
    ("Let me see.\n</think>\n\nParis.", True, "Let me see.", "Paris."),
    ("<think>\nLet me see.\n</think>\n\nParis.", True, "Let me see.", "Paris."),
    ("<think>\nA < B and </thi is no tag.\n</think>\n\nParis.", False, "A < B and </thi is no tag.", "Paris."),
    ("  Paris, no thinking.", False, "", "  Paris, no thinking."),
    ("Still thinking when cut off", True, "Still thinking when cut off", ""),
    ("<think>cut off <", False, "cut off <", ""),
    ("<think></think>Paris.", False, "", "Paris."),
    ("<thin", False, "", "<thin"),
]


def cuts(text: str) -> list[list[str]]:
    """The text in one piece, a character at a time, and in threes."""
    return [[text], list(text), [text[i:i + 3] for i in range(0, len(text), 3)]]


@pytest.mark.parametrize(("text", "starts_open", "reasoning", "content"), SPLITS)
def test_streamed_split_adds_up_to_the_whole_split_in_any_cut(text, starts_open, reasoning, content):
    whole = split_reasoning(text, starts_open)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for pieces in cuts(text):
        splitter = ReasoningSplitter(starts_open)
        streamed = [splitter.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert "".join(d.reasoning for d in streamed) == reasoning
        assert "".join(d.content for d in streamed) == content
        # Nothing of a tag is ever shown, and the answer starts only after the reasoning ended.
        assert all("<think>" not in d.reasoning and "</think>" not in d.reasoning for d in streamed)


def test_qwen3_opens_from_the_prompt_and_deepseek_r1_always():
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    assert not qwen3.starts_open("<|im_start|>assistant\n") and qwen3.starts_open("<|im_start|>assistant\n<think>\n")
    assert r1.starts_open("<|im_start|>assistant\n")


SCHEMA = OutputConstraint(StructuredOutputParams(GrammarKind.JSON_SCHEMA, json.dumps(
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})), "response_format")


@pytest.mark.parametrize(("starts_open", "text", "accepted"), [
    (True, 'Hmm, a < b, </thi.</think>\n\n{"a": 1}', True),
    (True, '<think>x</think>{"a": 1}', True),
    (True, '{"a": 1}', False),  # the answer comes only after the reasoning
    (True, 'x</think>{"a": "no"}', False),  # and is held to the schema
    (True, 'x</think></think>{"a": 1}', False),
    (False, '{"a": 1}', True),  # qwen3 may skip thinking
    (False, '<think>x</think> {"a": 2}', True),
    (False, 'x</think>{"a": 1}', False),
])
def test_the_grammar_lets_the_model_think_then_holds_the_answer(starts_open, text, accepted):
    constraint = after_reasoning(SCHEMA, starts_open)
    assert constraint.params.kind is GrammarKind.GRAMMAR and constraint.param == "response_format"
    assert xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(constraint.params.spec), text) is accepted


@pytest.mark.parametrize("constraint", [
    OutputConstraint(StructuredOutputParams(GrammarKind.JSON_OBJECT), "response_format"),
    OutputConstraint(StructuredOutputParams(GrammarKind.REGEX, "[0-9]+"), "guided_regex"),
    OutputConstraint(StructuredOutputParams(GrammarKind.CHOICE, '["yes", "no"]'), "guided_choice"),
    OutputConstraint(StructuredOutputParams(GrammarKind.GRAMMAR, 'root ::= "ok"'), "guided_grammar"),
])
def test_every_constraint_kind_applies_after_the_reasoning(constraint):
    grammar = xgr.Grammar.from_ebnf(after_reasoning(constraint, starts_open=True).params.spec)
    answers = {GrammarKind.JSON_OBJECT: '{"k": 1}', GrammarKind.REGEX: "42", GrammarKind.CHOICE: "no",
               GrammarKind.GRAMMAR: "ok"}
    assert xgr.testing._is_grammar_accept_string(grammar, f"thinking</think>{answers[constraint.params.kind]}")


def test_a_bad_constraint_is_a_400_naming_its_field():
    from kvserve.server.errors import APIError

    with pytest.raises(APIError) as raised:
        after_reasoning(OutputConstraint(StructuredOutputParams(GrammarKind.REGEX, "(["), "guided_regex"), starts_open=True)
    assert raised.value.status == 400 and raised.value.param == "guided_regex"


# ------------------------------------------------------------------------------------ over HTTP

R1 = ServerSettings(reasoning_parser="deepseek_r1")
R1_TOOLS = ServerSettings(reasoning_parser="deepseek_r1", enable_auto_tool_choice=True, tool_call_parser="hermes")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
THOUGHT = "The user asks about Paris. <tool_call> would be premature."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def _client(engine: ScriptedEngine, settings: ServerSettings) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(engine, settings))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=10) as http:
        yield http


async def _both(engine: ScriptedEngine, settings: ServerSettings, body: dict) -> tuple[dict, list[dict]]:
    async for http in _client(engine, settings):
        whole = await http.post("/v1/chat/completions", json=body)
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        assert whole.status_code == 200 and streamed.status_code == 200, whole.text
        return whole.json()["choices"][0], [c["choices"][0] for c in parse_sse(streamed.text) if c["choices"]]
    raise AssertionError("unreachable")


def _reassemble(chunks: list[dict]) -> dict:
    message: dict = {"reasoning": "", "content": "", "calls": {}}
    for chunk in chunks:
        delta = chunk["delta"]
        assert delta.get("reasoning") == delta.get("reasoning_content")
        message["reasoning"] += delta.get("reasoning") or ""
        message["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = message["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"]["arguments"]
    message["finish_reason"] = chunks[-1]["finish_reason"]
    return message


@pytest.mark.anyio
async def test_chat_reports_the_reasoning_apart_from_the_answer_streamed_or_not():
    engine = ScriptedEngine(f"{THOUGHT}\n</think>\n\nIt is sunny in Paris.", chars_per_step=2)
    whole, chunks = await _both(engine, R1, {"messages": [{"role": "user", "content": "Weather?"}]})
    message = whole["message"]
    assert message["reasoning"] == message["reasoning_content"] == THOUGHT
    assert message["content"] == "It is sunny in Paris." and whole["finish_reason"] == "stop"
    streamed = _reassemble(chunks)
    assert (streamed["reasoning"], streamed["content"], streamed["finish_reason"]) == \
        (THOUGHT, "It is sunny in Paris.", "stop")


@pytest.mark.anyio
async def test_tool_calls_are_read_from_the_answer_after_the_reasoning():
    engine = ScriptedEngine(f"{THOUGHT}</think>\n{CALL}", chars_per_step=3)
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    whole, chunks = await _both(engine, R1_TOOLS, body)
    message = whole["message"]
    assert whole["finish_reason"] == "tool_calls" and message["reasoning"] == THOUGHT and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", '{"city": "Paris"}')]
    streamed = _reassemble(chunks)
    assert streamed["reasoning"] == THOUGHT and streamed["content"] == "" and streamed["finish_reason"] == "tool_calls"
    assert list(streamed["calls"].values()) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


@pytest.mark.anyio
async def test_without_a_reasoning_parser_think_tags_stay_content():
    engine = ScriptedEngine("<think>x</think>Hi")
    async for http in _client(engine, ServerSettings()):
        reply = (await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "?"}]})).json()
        assert reply["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>Hi", "tool_calls": []}


@pytest.mark.anyio
@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"tools": TOOLS, "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
])
async def test_output_constraints_reach_the_engine_as_a_grammar_after_the_reasoning(extra):
    engine = ScriptedEngine("x</think>{}")
    async for http in _client(engine, R1):
        reply = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "?"}], **extra})
        assert reply.status_code == 200, reply.text
    constraint = engine.last_params.structured_output
    assert constraint is not None and constraint.kind is GrammarKind.GRAMMAR and "</think>" in constraint.spec
