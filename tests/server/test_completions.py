"""/v1/completions and /v1/chat/completions over the fake engine: OpenAI shapes and semantics."""

from __future__ import annotations

import httpx
import pytest

from tests.server.fake_engine import MODEL, FakeTokenizer, expected_token

pytestmark = pytest.mark.anyio


def expected_text(prompt: str, max_tokens: int, completion: int = 0) -> str:
    ids = FakeTokenizer().encode(prompt)
    return FakeTokenizer().decode([expected_token(ids, s, completion) for s in range(max_tokens)])


async def test_completion_shape_and_usage(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {"index": 0, "text": expected_text("hello", 5), "logprobs": None,
                      "finish_reason": "length", "stop_reason": None, "prompt_logprobs": None}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_default_max_tokens_is_16_and_model_is_optional(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/completions", json={"prompt": "hi"})).json()
    assert body["usage"]["completion_tokens"] == 16


async def test_n_and_prompt_lists_index_choices_prompt_major(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3})).json()
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert texts == [expected_text("ab", 3, 0), expected_text("ab", 3, 1), expected_text("cd", 3, 0),
                     expected_text("cd", 3, 1)]
    assert body["usage"]["prompt_tokens"] == 4  # each prompt once, not once per completion
    assert body["usage"]["completion_tokens"] == 12


async def test_token_id_prompts(client: httpx.AsyncClient) -> None:
    ids = FakeTokenizer().encode("xyz")
    one = (await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2})).json()
    two = (await client.post("/v1/completions", json={"prompt": [ids, ids], "max_tokens": 2})).json()
    assert one["choices"][0]["text"] == expected_text("xyz", 2)
    assert [c["text"] for c in two["choices"]] == [expected_text("xyz", 2)] * 2


async def test_echo_prepends_prompt(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/completions", json={"prompt": "say", "max_tokens": 3, "echo": True})).json()
    assert body["choices"][0]["text"] == "say" + expected_text("say", 3)


async def test_stop_string_is_not_leaked(client: httpx.AsyncClient) -> None:
    full = expected_text("hello", 8)
    stop = full[3:5]
    body = (await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "stop": stop})).json()
    choice = body["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


async def test_completion_logprobs_shape(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2})).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == list(body["choices"][0]["text"])
    assert logprobs["token_logprobs"] == [-0.25] * 3
    assert logprobs["text_offset"] == [0, 1, 2]
    assert all(len(top) == 2 and token in top for top, token in zip(logprobs["top_logprobs"], logprobs["tokens"]))


async def test_chat_completion_shape(client: httpx.AsyncClient) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                               "max_completion_tokens": 4, "n": 2})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    prompt = "<system>be brief\n<user>hi\n<assistant>"
    assert [c["message"] for c in body["choices"]] == [
        {"role": "assistant", "content": expected_text(prompt, 4, 0), "tool_calls": []},
        {"role": "assistant", "content": expected_text(prompt, 4, 1), "tool_calls": []}]
    assert body["usage"]["prompt_tokens"] == len(prompt.encode())


async def test_chat_default_max_tokens_fills_the_context(client: httpx.AsyncClient, engine) -> None:
    body = (await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})).json()
    assert body["usage"]["total_tokens"] == engine.max_model_len
    assert body["choices"][0]["finish_reason"] == "length"


async def test_chat_logprobs_shape(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 3})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    for entry in content:
        assert entry["logprob"] == -0.25 and entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3


async def test_models_version_tokenize_detokenize(client: httpx.AsyncClient, engine) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == engine.max_model_len
    assert "version" in (await client.get("/version")).json()
    tokens = (await client.post("/tokenize", json={"model": MODEL, "prompt": "abc"})).json()
    assert tokens == {"tokens": [98, 99, 100], "count": 3, "max_model_len": engine.max_model_len}
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]})).json()
    assert chat["count"] == len("<user>a\n<assistant>")
    text = (await client.post("/detokenize", json={"tokens": [98, 99, 100]})).json()
    assert text == {"prompt": "abc"}
    assert (await client.get("/health")).status_code == 200
