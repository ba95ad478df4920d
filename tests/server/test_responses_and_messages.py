"""/v1/responses and /v1/messages in-process: the framing of their streams, the translation of
their requests (and errors in their own field names), the response store's bounds, and how an
output that was cut off is reported."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from kvserve.engine import GrammarKind
from kvserve.server.app import build_app
from kvserve.server.responses_store import ResponsesStore
from kvserve.server.settings import ServerSettings
from tests.server.scripted_engine import ScriptedEngine

SCRIPT = "Hello there, how can I help?"


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedEngine]]:
    async for pair in _client(ScriptedEngine(SCRIPT), ServerSettings()):
        yield pair


async def _client(engine: ScriptedEngine, settings: ServerSettings):
    transport = httpx.ASGITransport(app=build_app(engine, settings))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=10) as http:
        yield http, engine


def named_events(body: str) -> list[dict]:
    """Each event's payload, checking that its `event:` line names its type."""
    events = []
    for block in (b for b in body.split("\n\n") if b.strip()):
        name_line, data_line = block.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {payload['type']}"
        events.append(payload)
    return events


@pytest.mark.anyio
async def test_responses_stream_numbers_its_events_and_ends_with_the_whole_response(scripted):
    http, _ = scripted
    whole = (await http.post("/v1/responses", json={"input": "hi"})).json()
    events = named_events((await http.post("/v1/responses", json={"input": "hi", "stream": True})).text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert text == SCRIPT == whole["output"][0]["content"][0]["text"]
    assert events[-1]["type"] == "response.completed" and final["status"] == whole["status"] == "completed"
    strip_ids = [{k: v for k, v in item.items() if k != "id"} for item in final["output"]]
    assert strip_ids == [{k: v for k, v in item.items() if k != "id"} for item in whole["output"]]
    assert final["usage"] == whole["usage"]


@pytest.mark.anyio
async def test_a_response_cut_off_by_max_output_tokens_is_incomplete(scripted):
    http, _ = scripted
    body = {"input": "hi", "max_output_tokens": 5}
    whole = (await http.post("/v1/responses", json=body)).json()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["status"] == "incomplete"
    events = named_events((await http.post("/v1/responses", json={**body, "stream": True})).text)
    assert events[-1]["type"] == "response.incomplete"


@pytest.mark.anyio
async def test_responses_input_items_reach_the_chat_template_as_messages(scripted):
    http, engine = scripted
    body = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []}]}
    assert (await http.post("/v1/responses", json=body)).status_code == 200
    prompt = engine.tokenizer.decode(engine.last_prompt_ids)
    assert prompt == "<system>Be brief.\n<user>Weather?\n<assistant>\n<tool>sunny\n<assistant>"


@pytest.mark.anyio
async def test_text_format_becomes_the_structured_output_constraint(scripted):
    http, engine = scripted
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    reply = await http.post("/v1/responses", json={"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}})
    assert reply.status_code == 200 and reply.json()["text"]["format"]["name"] == "thing"
    constraint = engine.last_params.structured_output
    assert constraint.kind is GrammarKind.JSON_SCHEMA and json.loads(constraint.spec) == schema


@pytest.mark.anyio
@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
])
async def test_responses_errors_name_the_responses_field(scripted, body, param):
    http, _ = scripted
    reply = await http.post("/v1/responses", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.mark.anyio
async def test_with_the_store_off_previous_response_id_and_retrieval_are_clear_400s():
    async for http, _ in _client(ScriptedEngine(SCRIPT), ServerSettings(enable_responses_store=False)):
        first = (await http.post("/v1/responses", json={"input": "hi"})).json()
        assert first["store"] is False
        for reply in (await http.post("/v1/responses", json={"input": "more", "previous_response_id": first["id"]}),
                      await http.get(f"/v1/responses/{first['id']}")):
            assert reply.status_code == 400 and "--no-enable-responses-store" in reply.json()["error"]["message"]


def test_the_store_drops_the_least_recently_used_past_either_cap():
    store = ResponsesStore(max_responses=2, max_bytes=10_000)
    for name in ("a", "b"):
        store.put({"id": name}, [])
    store.get("a")  # now b is the least recently used
    store.put({"id": "c"}, [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    small = ResponsesStore(max_responses=100, max_bytes=300)
    for i in range(10):
        small.put({"id": f"r{i}", "text": "x" * 50}, [])
    assert small.size_bytes <= 300 and small.get("r9") is not None and small.get("r0") is None
    assert not small.put({"id": "huge", "text": "x" * 1000}, []) and small.get("huge") is None


# ----------------------------------------------------------------------------------- messages

@pytest.mark.anyio
async def test_messages_stream_adds_up_to_the_message(scripted):
    http, _ = scripted
    body = {"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
    whole = (await http.post("/v1/messages", json=body)).json()
    events = named_events((await http.post("/v1/messages", json={**body, "stream": True})).text)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-2:] == ["message_delta",
                                                                                         "message_stop"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert whole["content"] == [{"type": "text", "text": text}] and text == SCRIPT
    assert events[-2]["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    assert whole["stop_reason"] == "end_turn" and events[-2]["usage"] == whole["usage"]


@pytest.mark.anyio
async def test_messages_cut_off_stop_with_max_tokens(scripted):
    http, _ = scripted
    reply = (await http.post("/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}))
    assert reply.json()["stop_reason"] == "max_tokens" and reply.json()["content"][0]["text"] == SCRIPT[:4]


@pytest.mark.anyio
async def test_a_max_tokens_above_the_servers_cap_is_taken_as_the_cap(scripted):
    http, engine = scripted  # Claude Code sends max_tokens 32000 as a ceiling
    reply = await http.post("/v1/messages", json={"max_tokens": 32000, "messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 200 and engine.last_params.max_tokens <= ServerSettings().limits.max_tokens


@pytest.mark.anyio
async def test_messages_translate_system_tool_use_and_tool_result(scripted):
    http, engine = scripted
    body = {"max_tokens": 10, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["END"],
            "top_k": 5, "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "system", "content": [{"type": "text", "text": "Now: noon."}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                  {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "sunny"}]}, {"type": "text", "text": "And?"}]}]}
    assert (await http.post("/v1/messages", json=body)).status_code == 200
    prompt = engine.tokenizer.decode(engine.last_prompt_ids)
    assert prompt == ("<system>Be brief.\n<user>Weather?\n<system>Now: noon.\n<assistant>\n<tool>sunny\n<user>And?\n"
                      "<assistant>")
    assert engine.last_params.stop == ("END",) and engine.last_params.top_k == 5


@pytest.mark.anyio
@pytest.mark.parametrize(("body", "status", "kind", "needle"), [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": "prefill"}]}, 400, "invalid_request_error",
     "prefill"),
    ({"max_tokens": 5, "model": "claude-x", "messages": [{"role": "user", "content": "x"}]}, 404, "not_found_error",
     "does not exist"),
])
async def test_messages_errors_have_anthropics_shape(scripted, body, status, kind, needle):
    http, _ = scripted
    reply = await http.post("/v1/messages", json=body)
    error = reply.json()
    assert reply.status_code == status and error["type"] == "error" and error["error"]["type"] == kind
    assert needle in error["error"]["message"]


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/input_tokens", "/v1/messages",
                                  "/v1/messages/count_tokens"])
async def test_the_new_routes_need_the_api_key_in_either_header(path):
    body = {"input": "hi", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    async for http, _ in _client(ScriptedEngine(SCRIPT), ServerSettings(api_key="sekrit")):
        assert (await http.post(path, json=body)).status_code == 401
        assert (await http.post(path, json=body, headers={"x-api-key": "sekrit"})).status_code == 200
        assert (await http.post(path, json=body, headers={"Authorization": "Bearer sekrit"})).status_code == 200


@pytest.mark.anyio
async def test_a_prompt_too_long_for_the_context_says_so_in_anthropics_words():
    async for http, _ in _client(ScriptedEngine(SCRIPT), ServerSettings()):  # Claude Code looks for the words
        reply = await http.post("/v1/messages", json={"max_tokens": 10, "messages": [
            {"role": "user", "content": "x" * 5000}]})
        assert reply.status_code == 400 and reply.json()["error"]["message"].startswith("prompt is too long: ")


class _FailsMidway(ScriptedEngine):
    """Writes one step of the script, then the engine fails."""

    async def generate(self, prompt, sampling_params, request_id, *, priority=0, cache_salt=None):
        async for output in super().generate(prompt, sampling_params, request_id, priority=priority,
                                             cache_salt=cache_salt):
            yield output
            raise RuntimeError("the engine broke")


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body", "check"), [
    ("/v1/responses", {"input": "hi"}, lambda e: e["type"] == "error" and "the engine broke" in e["message"]),
    ("/v1/messages", {"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]},
     lambda e: e == {"type": "error", "error": {"type": "api_error", "message": e["error"]["message"]}}),
])
async def test_a_stream_that_fails_ends_with_the_apis_error_event(path, body, check):
    async for http, _ in _client(_FailsMidway(SCRIPT), ServerSettings()):
        events = named_events((await http.post(path, json={**body, "stream": True})).text)
        assert check(events[-1]) and len(events) > 2, events[-1]
