"""The Responses and Messages APIs through the official clients over real sockets (issue 25):
openai's `responses.create` / `responses.stream`, the openai-agents SDK with its default
(Responses) model and a function tool, anthropic's `messages.create` / `messages.stream` and a
tool round trip. A scripted engine writes the model's side (reasoning, text, Hermes tool calls);
the streamed objects the SDKs reassemble equal the non-streamed ones."""

from __future__ import annotations

import anthropic
import openai
import pytest
from agents import Agent, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider

from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.live_server import live_server
from tests.server.scripted_engine import ScriptedEngine

SETTINGS = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
THOUGHT = "The user wants the weather; I should call the tool."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."


def weather_script(prompt: str) -> str:
    """Calls the tool until its result is in the conversation, then answers with it."""
    if "<tool>" in prompt:  # the fake tokenizer's template writes a tool turn as <tool>...
        return f"{THOUGHT}</think>\n\n{ANSWER}"
    return f"{THOUGHT}</think>\nLet me check.\n{CALL}"


PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather",
                    "parameters": PARAMETERS}]
MESSAGES_TOOLS = [{"name": "get_weather", "description": "Current weather", "input_schema": PARAMETERS}]


@pytest.fixture(scope="module")
def url():
    with live_server(build_app(ScriptedEngine(weather_script, chars_per_step=2), SETTINGS)) as base:
        yield base


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _summary(response) -> list[tuple]:
    items = []
    for item in response.output:
        if item.type == "reasoning":
            items.append(("reasoning", "".join(c.text for c in item.content or [])))
        elif item.type == "message":
            items.append(("message", "".join(c.text for c in item.content)))
        else:
            items.append((item.type, item.name, item.arguments))
    return items


def test_openai_responses_create_and_stream_give_the_same_response(url):
    client = _openai(url)
    body = {"model": "fake-model", "input": "Weather in Paris?", "tools": RESPONSES_TOOLS}
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    expected = [("reasoning", THOUGHT), ("message", "Let me check."),
                ("function_call", "get_weather", '{"city": "Paris"}')]
    assert whole.status == "completed" and _summary(whole) == expected
    assert streamed.status == "completed" and _summary(streamed) == expected
    assert whole.output_text == "Let me check." and whole.usage.output_tokens > 0
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.reasoning_text.delta" in kinds


def test_openai_responses_continue_a_stored_response_with_the_tool_result(url):
    client = _openai(url)
    first = client.responses.create(model="fake-model", input="Weather in Paris?", tools=RESPONSES_TOOLS)
    call = next(item for item in first.output if item.type == "function_call")
    follow_up = client.responses.create(
        model="fake-model", previous_response_id=first.id, tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}])
    assert follow_up.output_text == ANSWER and follow_up.previous_response_id == first.id
    assert client.responses.retrieve(first.id).id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    count = client.responses.input_tokens.count(model="fake-model", input="Weather in Paris?", tools=RESPONSES_TOOLS)
    assert count.input_tokens == first.usage.input_tokens


def test_openai_agents_default_responses_model_runs_a_function_tool(url):
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "sunny, 24 C"

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model="fake-model")
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True), tracing_disabled=True)
    result = Runner.run_sync(agent, "Weather in Paris?", run_config=config, max_turns=4)
    assert calls == ["Paris"] and result.final_output == ANSWER


def _anthropic(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


def _blocks(message) -> list[tuple]:
    return [(b.type, b.thinking) if b.type == "thinking" else (b.type, b.text) if b.type == "text"
            else (b.type, b.name, b.input) for b in message.content]


def test_anthropic_messages_create_and_stream_give_the_same_message(url):
    client = _anthropic(url)
    body = {"model": "fake-model", "max_tokens": 400, "tools": MESSAGES_TOOLS,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()
    expected = [("thinking", THOUGHT), ("text", "Let me check."), ("tool_use", "get_weather", {"city": "Paris"})]
    assert _blocks(whole) == expected and whole.stop_reason == "tool_use"
    assert _blocks(streamed) == expected and streamed.stop_reason == "tool_use"
    assert "".join(texts) == "Let me check."
    assert streamed.usage.output_tokens == whole.usage.output_tokens and whole.usage.input_tokens > 0


def test_anthropic_tool_round_trip(url):
    client = _anthropic(url)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model="fake-model", max_tokens=400, tools=MESSAGES_TOOLS, messages=messages)
    use = next(b for b in first.content if b.type == "tool_use")
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    final = client.messages.create(model="fake-model", max_tokens=400, tools=MESSAGES_TOOLS, messages=messages)
    assert final.stop_reason == "end_turn" and _blocks(final) == [("thinking", THOUGHT), ("text", ANSWER)]
    count = client.messages.count_tokens(model="fake-model", tools=MESSAGES_TOOLS, messages=messages)
    assert count.input_tokens == final.usage.input_tokens


def test_anthropic_errors_reach_the_client_in_its_shape(url):
    client = _anthropic(url)
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="claude-nonexistent", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert raised.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="fake-model", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "images are not supported" in raised.value.body["error"]["message"]
