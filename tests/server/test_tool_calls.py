"""Forced tool calls (issue 13): with tool_choice "required" or a named function the grammar
engine guarantees the call's shape, and the answer is OpenAI's message.tool_calls (streamed as
tool-call deltas), read with the openai client; tool calls and tool results in the history reach
the chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
from openai import OpenAI

from kvserve.engine.text.chat_template import ChatTemplate
from kvserve.server.prompts import chat_messages
from kvserve.server.protocol import ChatMessage
from tests.server.tiny_server import MODEL, TinyServer, tiny_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    with tiny_server(tmp_path_factory.mktemp("tools")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


def assert_valid(call) -> None:
    arguments = json.loads(call.function.arguments, strict=False)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    assert call.id and call.type == "function"


@pytest.mark.parametrize("seed", [0, 1])
def test_named_tool_choice(client, seed):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, seed=seed, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert_valid(call)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(client, parallel):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, seed=3, max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    if not parallel:
        assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert_valid(call)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_streamed_tool_call_deltas(client, tool_choice):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                            parallel_tool_calls=False, seed=5, max_tokens=300, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function.name:
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    if isinstance(tool_choice, dict):
        assert call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"], strict=False), SCHEMAS[call["name"]])


def test_tool_choice_none_answers_in_text(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=5)
    assert reply.choices[0].message.tool_calls in (None, []) and reply.choices[0].finish_reason != "tool_calls"


def test_tool_calls_and_results_in_the_history_reach_the_template():
    template = ChatTemplate(
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>"
        "{% for c in m.tool_calls or [] %}call {{ c.function.name }}({{ c.function.arguments }}){% endfor %}"
        "{% if m.tool_call_id %}result for {{ m.tool_call_id }}: {% endif %}{{ m.content or '' }}"
        "{% endfor %}")
    history = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]]
    rendered = template.render(chat_messages(history), tools=TOOLS, add_generation_prompt=False)
    assert rendered == ('[tool get_weather][tool get_time]<user>Weather?<assistant>call get_weather({"city": "Paris"})'
                        "<tool>result for call_1: 18C")


def test_a_turn_with_only_tool_calls_renders_in_a_template_that_concatenates_content():
    # OpenAI clients (langchain's agents among them) send such a turn with "content": null;
    # SmolLM2's ChatML template, like many, does `'...' + message['content']`.
    template = ChatTemplate("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}")
    history = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]]
    assert template.render(chat_messages(history), add_generation_prompt=False) == "<user>Weather?<assistant><tool>18C"
