"""The four tool_choice modes over HTTP, streamed and not (issue 13), with a scripted model
output so the server's reading of it is tested exactly: message.tool_calls and finish_reason
"tool_calls"; streamed, OpenAI's tool-call deltas (id and name first, then argument fragments as
they arrive) that reassemble to the non-streamed message; content before a call streams as
content; marker text never does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.scripted_engine import ScriptedEngine
from tests.server.sse import parse_sse

pytestmark = pytest.mark.anyio

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_REPLY = (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
AUTO_CALLS = [("get_weather", WEATHER), ("get_time", "{}")]


def app_client(script: str, parser: str | None = "hermes", chars_per_step: int = 3,
               engine: ScriptedEngine | None = None) -> httpx.AsyncClient:
    engine = engine or ScriptedEngine(script, chars_per_step)
    settings = ServerSettings(enable_auto_tool_choice=parser is not None, tool_call_parser=parser)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, settings)),
                             base_url="http://testserver", timeout=10)


async def chat(script: str, body: dict, parser: str | None = "hermes", chars_per_step: int = 3) -> httpx.Response:
    async with app_client(script, parser, chars_per_step) as http:
        return await http.post("/v1/chat/completions",
                               json={"messages": USER, "tools": TOOLS, "max_tokens": 1000, **body})


def valid_id(call_id: str) -> bool:
    """OpenAI's style, or the 9 alphanumerics Mistral's templates demand."""
    return call_id.startswith("call_") or (len(call_id) == 9 and call_id.isalnum())


def message_of(response: httpx.Response) -> tuple[str | None, list[tuple[str, str]], str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    for call in calls:
        assert valid_id(call["id"]) and call["type"] == "function"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    return (choice["message"]["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
            choice["finish_reason"])


def streamed(response: httpx.Response) -> tuple[str | None, list[tuple[str, str]], str, list[dict]]:
    """Reassembles a streamed choice 0 as a client does; also returns its chunks' deltas."""
    assert response.status_code == 200, response.text
    content, calls, finish, deltas = "", {}, None, []
    for chunk in parse_sse(response.text):
        for choice in chunk["choices"]:
            deltas.append(choice["delta"])
            finish = choice["finish_reason"] or finish
            content += choice["delta"].get("content") or ""
            for entry in choice["delta"].get("tool_calls", []):
                if "id" in entry:
                    assert entry["index"] not in calls and entry["type"] == "function"
                    assert entry["function"]["arguments"] == "" and valid_id(entry["id"])
                    calls[entry["index"]] = [entry["function"]["name"], ""]
                else:
                    calls[entry["index"]][1] += entry["function"]["arguments"]
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish, deltas


MODES = [
    # (tool_choice, scripted output, parser, expected content, expected calls, finish_reason)
    ("none", HERMES_REPLY, "hermes", HERMES_REPLY, [], "stop"),
    ("auto", HERMES_REPLY, "hermes", "Let me look.", AUTO_CALLS, "tool_calls"),
    ("auto", "No tool needed: it is sunny.", "hermes", "No tool needed: it is sunny.", [], "stop"),
    ("auto", f'{{"name": "get_weather", "parameters": {WEATHER}}}', "llama3_json", None,
     [("get_weather", WEATHER)], "tool_calls"),
    ("auto", f'Checking. [TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]', "mistral", "Checking.",
     [("get_weather", WEATHER)], "tool_calls"),
    ("auto", f'Sure! {{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "get_time", "parameters": {{}}}}',
     "llama3_json", "Sure!", AUTO_CALLS, "tool_calls"),
    ("auto", f'Checking.[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{{}}', "mistral", "Checking.",
     AUTO_CALLS, "tool_calls"),
    ("auto", f'get_weather{WEATHER}get_time{{}}', "mistral", None, AUTO_CALLS, "tool_calls"),  # markers skipped
    ("auto", '[TOOL_CALLS]get weather{"city": "Paris"}', "mistral", '[TOOL_CALLS]get weather{"city": "Paris"}', [],
     "stop"),  # malformed: content, never an error
    ("required", f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "get_time", "parameters": {{}}}}]',
     None, None, AUTO_CALLS, "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, WEATHER, None, None, [("get_weather", WEATHER)],
     "tool_calls"),
]
MODE_IDS = ["none", "auto-hermes", "auto-no-call", "auto-llama3", "auto-mistral", "auto-llama3-text-first",
            "auto-mistral-v11", "auto-mistral-v11-bare", "auto-mistral-malformed", "required", "named"]


@pytest.mark.parametrize(("tool_choice", "script", "parser", "content", "calls", "finish"), MODES, ids=MODE_IDS)
async def test_non_streamed(tool_choice, script, parser, content, calls, finish):
    response = await chat(script, {"tool_choice": tool_choice}, parser)
    assert message_of(response) == (content, calls, finish)


@pytest.mark.parametrize("chars_per_step", [1, 3, 1000])
@pytest.mark.parametrize(("tool_choice", "script", "parser", "content", "calls", "finish"), MODES, ids=MODE_IDS)
async def test_streamed_equals_non_streamed(tool_choice, script, parser, content, calls, finish, chars_per_step):
    response = await chat(script, {"tool_choice": tool_choice, "stream": True}, parser, chars_per_step)
    assert streamed(response)[:3] == (content, calls, finish)


async def test_arguments_stream_in_fragments_after_the_name_and_content_comes_first():
    response = await chat(HERMES_REPLY, {"tool_choice": "auto", "stream": True}, chars_per_step=2)
    *_, deltas = streamed(response)
    kinds = [("content" if d.get("content") else "call" if "id" in d["tool_calls"][0] else "arguments")
             for d in deltas if d.get("content") or d.get("tool_calls")]
    assert kinds[0] == "content" and kinds.count("call") == 2
    assert kinds.count("arguments") > len(WEATHER) // 2  # fragments as generated, not one blob
    assert kinds.index("call") < kinds.index("arguments")
    streamed_content = "".join(d.get("content") or "" for d in deltas)
    assert "<tool_call>" not in streamed_content and "</tool_call>" not in streamed_content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
async def test_forced_calls_stream_their_arguments_as_generated(tool_choice):
    script = (WEATHER if isinstance(tool_choice, dict) else f'[{{"name": "get_weather", "parameters": {WEATHER}}}]')
    response = await chat(script, {"tool_choice": tool_choice, "stream": True}, None, chars_per_step=2)
    *_, deltas = streamed(response)
    fragments = [e for d in deltas for e in d.get("tool_calls", []) if "id" not in e]
    assert len(fragments) >= len(WEATHER) // 2


async def test_tool_choice_defaults_to_auto_with_tools():
    response = await chat(HERMES_REPLY, {})
    assert message_of(response) == ("Let me look.", AUTO_CALLS, "tool_calls")


@pytest.mark.parametrize("tool_choice", ["auto", None])
async def test_auto_without_the_flag_is_a_400_naming_it(tool_choice):
    body = {} if tool_choice is None else {"tool_choice": tool_choice}
    response = await chat(HERMES_REPLY, body, parser=None)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]


async def test_a_reply_cut_off_by_max_tokens_inside_a_call_is_content():
    script = f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER}}}</tool_call>'
    response = await chat(script, {"tool_choice": "auto", "max_tokens": 30})
    assert message_of(response) == (script[:30], [], "length")


async def test_each_streamed_choice_has_its_own_calls_and_logprobs_are_kept():
    response = await chat(HERMES_REPLY, {"tool_choice": "auto", "stream": True, "n": 2, "logprobs": True})
    chunks = parse_sse(response.text)
    for index in (0, 1):
        choice_chunks = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        calls = [e for c in choice_chunks for e in c["delta"].get("tool_calls", []) if "id" in e]
        assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
        assert [c["index"] for c in calls] == [0, 1]
        logprobs = sum(len(c["logprobs"]["content"]) for c in choice_chunks if c.get("logprobs"))
        assert logprobs == len(HERMES_REPLY)  # one per generated token, even those held back
        assert choice_chunks[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
async def test_mistral_calls_get_the_ids_its_chat_template_accepts_back(tool_choice, stream):
    script = (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]' if tool_choice == "auto"
              else f'[{{"name": "get_weather", "parameters": {WEATHER}}}]')
    response = await chat(script, {"tool_choice": tool_choice, "stream": stream}, "mistral")
    if stream:
        ids = [e["id"] for d in streamed(response)[3] for e in d.get("tool_calls", []) if "id" in e]
    else:
        ids = [c["id"] for c in response.json()["choices"][0]["message"]["tool_calls"]]
    assert len(ids) == 1 and len(ids[0]) == 9 and ids[0].isalnum()


async def test_auto_leaves_the_output_unconstrained_and_forced_modes_constrain_it():
    engine = ScriptedEngine(HERMES_REPLY)
    async with app_client(HERMES_REPLY, engine=engine) as http:
        for tool_choice, constrained in [("auto", False), ("required", True), ("none", False)]:
            await http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": tool_choice})
            assert (engine.last_params.structured_output is not None) == constrained


# The same two calls in each family's format: with parallel_tool_calls false only the first is returned.
TWO_CALLS = [("hermes", HERMES_REPLY, "Let me look."),
             ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}; '
                             '{"name": "get_time", "parameters": {}}', None),
             ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
                         '{"name": "get_time", "arguments": {}}]', None),
             ("mistral", f'Checking.[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{{}}', "Checking.")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("parser", "script", "content"), TWO_CALLS, ids=["hermes", "llama3", "mistral", "mistral-v11"])
async def test_auto_without_parallel_tool_calls_returns_only_the_first_call(parser, script, content, stream):
    both = await chat(script, {"stream": stream}, parser, chars_per_step=2)
    first = await chat(script, {"stream": stream, "parallel_tool_calls": False}, parser, chars_per_step=2)
    read = streamed if stream else message_of
    assert read(both)[:3] == (content, AUTO_CALLS, "tool_calls")
    assert read(first)[:3] == (content, AUTO_CALLS[:1], "tool_calls")
    if stream:
        indexes = {e["index"] for d in streamed(first)[3] for e in d.get("tool_calls", [])}
        assert indexes == {0}


async def test_required_without_parallel_tool_calls_asks_the_grammar_for_one_call():
    engine = ScriptedEngine(f'[{{"name": "get_weather", "parameters": {WEATHER}}}]')
    async with app_client(engine.script, engine=engine) as http:
        for parallel, max_items in [(True, None), (False, 1)]:
            response = await http.post("/v1/chat/completions", json={
                "messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel})
            assert message_of(response)[1] == [("get_weather", WEATHER)]
            assert json.loads(engine.last_params.structured_output.spec).get("maxItems") == max_items
