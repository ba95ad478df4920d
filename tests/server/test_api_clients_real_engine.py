"""The Responses and Messages APIs over the real engine: the default model, shown one Hermes call
in its history, calls the tool through `responses.create` and `messages.create` (slow); a tiny
model whose chat template opens `<think>` has its output reported as reasoning, with an output
grammar that the real engine compiles behind the reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from kvserve.server.settings import ServerSettings
# default_model_url: the default model behind --tool-call-parser hermes (a module fixture, one engine here too)
from tests.server.test_tool_calls_clients import FEW_SHOT, default_model_url  # noqa: F401
from tests.server.tiny_checkpoint import CHATML
from tests.server.tiny_server import tiny_server

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.slow
def test_default_model_calls_the_tool_through_responses_and_messages(default_model_url):
    system, *turns = FEW_SHOT
    responses = openai.OpenAI(base_url=f"{default_model_url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = responses.responses.create(
        model="SmolLM2-135M-Instruct", instructions=system["content"], input=turns, temperature=0,
        max_output_tokens=60, tools=[{"type": "function", "name": "get_weather", "parameters": PARAMETERS}])
    [call] = [item for item in reply.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})

    messages = anthropic.Anthropic(base_url=default_model_url, api_key="unused", max_retries=0, timeout=120)
    message = messages.messages.create(
        model="SmolLM2-135M-Instruct", system=system["content"], messages=turns, max_tokens=60,
        extra_body={"temperature": 0},  # this anthropic client no longer takes temperature as an argument
        tools=[{"name": "get_weather", "input_schema": PARAMETERS}])
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert (use.name, use.input, message.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")


THINKING_CHATML = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def thinking_url(tmp_path_factory) -> Iterator[str]:
    from tests.server.tiny_checkpoint import write_tiny_checkpoint

    folder = write_tiny_checkpoint(Path(tmp_path_factory.mktemp("thinking")) / "tiny")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_CHATML}))
    with tiny_server(folder, ServerSettings(reasoning_parser="qwen3"), model=folder) as server:
        yield server.url


def test_a_template_that_opens_think_makes_the_output_reasoning(thinking_url):
    client = openai.OpenAI(base_url=f"{thinking_url}/v1", api_key="unused", max_retries=0, timeout=120)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 12}
    plain = client.chat.completions.create(**body).choices[0].message
    # The random model never closes its thinking: all it writes is reasoning, none of it content.
    assert plain.model_extra["reasoning"] == plain.model_extra["reasoning_content"] and plain.content is None
    constrained = client.chat.completions.create(**body, response_format={"type": "json_object"})
    assert constrained.choices[0].message.content is None
    reply = client.responses.create(model="tiny", input="hi", temperature=0, max_output_tokens=12)
    assert [item.type for item in reply.output] == ["reasoning"] and reply.status == "incomplete"
