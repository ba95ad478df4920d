"""tool_choice "auto" through the official openai client over real sockets (issue 13): its
streaming helper reassembles our tool-call deltas into the same message as the non-streamed
reply, for a scripted output; and the default model, shown one call in Hermes format in its
history, makes a call the hermes parser reads (slow)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.config import EngineConfig
from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.live_server import live_server
from tests.server.scripted_engine import ScriptedEngine

HERMES = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCRIPT = ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"ZH\\""}}\n</tool_call>')


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def summary(completion) -> tuple:
    choice = completion.choices[0]
    return (choice.finish_reason, choice.message.content or None,
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []])


def test_openai_stream_helper_reassembles_auto_calls_as_the_non_streamed_reply():
    with live_server(build_app(ScriptedEngine(SCRIPT, chars_per_step=2), HERMES)) as url:
        client = client_for(url)
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
        whole = summary(client.chat.completions.create(**body))
        with client.chat.completions.stream(**body) as stream:
            names = [event.name for event in stream if event.type == "tool_calls.function.arguments.done"]
            streamed = summary(stream.get_final_completion())
    assert whole == ("tool_calls", "Checking both.", [("get_weather", '{"city": "Paris"}'),
                                                      ("get_weather", '{"city": "Zürich \\"ZH\\""}')])
    assert streamed == whole and names == ["get_weather", "get_weather"]


FAMILY_SCRIPTS = [
    ("llama3_json", 'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Z\u00fcrich"}}', "Sure!"),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Z\u00fcrich"}', "Checking."),
]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(("parser", "script", "content"), FAMILY_SCRIPTS, ids=["llama3_json", "mistral-v11"])
def test_openai_stream_helper_reassembles_each_family_as_the_non_streamed_reply(parser, script, content, parallel):
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser=parser)
    with live_server(build_app(ScriptedEngine(script, chars_per_step=2), settings)) as url:
        client = client_for(url)
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
                "parallel_tool_calls": parallel}
        whole = summary(client.chat.completions.create(**body))
        with client.chat.completions.stream(**body) as stream:
            for _ in stream:
                pass
            streamed = summary(stream.get_final_completion())
    calls = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Z\u00fcrich"}')]
    assert whole == ("tool_calls", content, calls if parallel else calls[:1])
    assert streamed == whole


# Shown one call in its history, SmolLM2-135M-Instruct (whose chat template does not render tools)
# answers the next question with a call in the same format, greedily.
FEW_SHOT = [
    {"role": "system", "content": "You can call get_weather(city). To call it, reply with exactly "
                                  '<tool_call>{"name": "get_weather", "arguments": {"city": "CITY"}}</tool_call>.'},
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def default_model_url() -> Iterator[str]:
    engine = AsyncEngine.from_config(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=512))
    engine.start()
    try:
        with live_server(build_app(engine, HERMES)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_default_model_makes_an_auto_call_streamed_and_not(default_model_url):
    client = client_for(default_model_url)
    body = {"model": "SmolLM2-135M-Instruct", "messages": FEW_SHOT, "tools": TOOLS, "temperature": 0, "max_tokens": 60}
    whole = summary(client.chat.completions.create(**body))
    with client.chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        streamed = summary(stream.get_final_completion())
    assert whole == ("tool_calls", None, [("get_weather", '{"city": "Paris"}')])
    assert streamed == whole
