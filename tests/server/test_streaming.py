"""Server-sent-event streams: shapes, deltas that add up to the full answer, the usage chunk."""

from __future__ import annotations

import httpx
import pytest

from tests.server.sse import parse_sse

pytestmark = pytest.mark.anyio


async def stream(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    response = await client.post(path, json={**body, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    return parse_sse(response.text)


async def test_completion_stream_adds_up_to_the_non_streamed_answer(client: httpx.AsyncClient) -> None:
    request = {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 6, "stop": "q"}
    whole = (await client.post("/v1/completions", json=request)).json()
    chunks = await stream(client, "/v1/completions", request)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and chunk["id"] == chunks[0]["id"]
        assert chunk["usage"] is None
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"] is not None:
                assert choice["index"] not in finish, "a choice finishes once"
                finish[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in whole["choices"]}


async def test_completion_stream_usage_chunk_comes_last(client: httpx.AsyncClient) -> None:
    chunks = await stream(client, "/v1/completions", {"prompt": "hey", "max_tokens": 4,
                                                       "stream_options": {"include_usage": True}})
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_completion_stream_echo_and_logprobs(client: httpx.AsyncClient) -> None:
    echo = await stream(client, "/v1/completions", {"prompt": "hey", "max_tokens": 2, "echo": True})
    assert echo[0]["choices"][0]["text"] == "hey"
    logprobs = await stream(client, "/v1/completions", {"prompt": "hey", "max_tokens": 3, "logprobs": 1})
    offsets = [o for c in logprobs for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2]


async def test_chat_stream_role_first_then_content_then_finish(client: httpx.AsyncClient) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2}
    whole = (await client.post("/v1/chat/completions", json=request)).json()
    chunks = await stream(client, "/v1/chat/completions", {**request, "stream_options": {"include_usage": True}})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    firsts = [c["choices"][0] for c in chunks[:2]]
    assert [f["delta"] for f in firsts] == [{"role": "assistant", "content": ""}] * 2
    assert [f["index"] for f in firsts] == [0, 1]
    content = {0: "", 1: ""}
    for chunk in chunks[2:-1]:
        choice = chunk["choices"][0]
        content[choice["index"]] += choice["delta"].get("content", "")
    assert content == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


async def test_chat_stream_logprobs_per_chunk(client: httpx.AsyncClient) -> None:
    chunks = await stream(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 3, "logprobs": True})
    entries = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == 3
