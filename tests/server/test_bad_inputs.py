"""The bad-input battery: each case gets the right status and an OpenAI error body naming the
problem, and the server stays healthy and correct afterwards."""

from __future__ import annotations

import httpx
import pytest

from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL

pytestmark = pytest.mark.anyio

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, path, json body, expected status, expected param)
CASES = [
    ("missing prompt", C, {"model": MODEL}, 400, "prompt"),
    ("prompt wrong type", C, {"prompt": 5}, 400, "prompt"),
    ("empty prompt list", C, {"prompt": []}, 400, "prompt"),
    ("empty string prompt", C, {"prompt": ""}, 400, "prompt"),
    ("token id outside vocab", C, {"prompt": [1, 99999]}, 400, "prompt"),
    ("negative token id", C, {"prompt": [-1]}, 400, "prompt"),
    ("logit_bias token outside vocab", C, {"prompt": "a", "logit_bias": {"300": 1}}, 400, "logit_bias"),
    ("stop_token_ids outside vocab", C, {"prompt": "a", "stop_token_ids": [1, 300]}, 400, "stop_token_ids"),
    ("max_tokens zero", C, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens string", C, {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature negative", C, {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("top_p zero", C, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top_k negative", C, {"prompt": "a", "top_k": -5}, 400, "top_k"),
    ("min_p above one", C, {"prompt": "a", "min_p": 1.5}, 400, "min_p"),
    ("n zero", C, {"prompt": "a", "n": 0}, 400, "n"),
    ("presence_penalty out of range", C, {"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty"),
    ("frequency_penalty out of range", C, {"prompt": "a", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repetition_penalty zero", C, {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit_bias key not a token", C, {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit_bias value too big", C, {"prompt": "a", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("logprobs negative", C, {"prompt": "a", "logprobs": -1}, 400, "logprobs"),
    ("empty stop string", C, {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("min_tokens above max_tokens", C, {"prompt": "a", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("unsupported suffix", C, {"prompt": "a", "suffix": "z"}, 400, "suffix"),
    ("unsupported best_of", C, {"prompt": "a", "best_of": 3}, 400, "best_of"),
    ("stream_options without stream", C, {"prompt": "a", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("known field with an unknown one beside it", C, {"prompt": "a", "top_p": 0, "no_stop_trim": True}, 400, "top_p"),
    ("max_tokens zero without echo", C, {"prompt": "a", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens"),
    ("max_tokens zero streamed", C, {"prompt": "a", "max_tokens": 0, "echo": True, "stream": True}, 400,
     "max_tokens"),
    ("prompt_logprobs negative", C, {"prompt": "a", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("prompt longer than context", C, {"prompt": "x" * 200}, 400, "prompt"),
    ("prompt plus max_tokens beyond context", C, {"prompt": "x" * 100, "max_tokens": 50}, 400, "max_tokens"),
    ("unknown model", C, {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    ("bad stream_options", C, {"prompt": "a", "stream": True, "stream_options": {"x": 1}}, 400, "stream_options.x"),
    ("chat without messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("chat empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("chat bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("chat image content", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("chat template refuses", CHAT, {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
    ("chat top_logprobs without logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat tool without function", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    ("chat tool_choice auto without --enable-auto-tool-choice", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                                     "tool_choice": "auto"}, 400, "tool_choice"),
    ("chat tool_choice names an unknown tool", CHAT,
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("chat tool_choice required without tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400,
     "tool_choice"),
    ("chat max_completion_tokens beyond context", CHAT, {"messages": USER, "max_completion_tokens": 1000}, 400,
     "max_completion_tokens"),
    ("tokenize neither prompt nor messages", "/tokenize", {}, 400, "prompt"),
    ("detokenize bad ids", "/detokenize", {"tokens": [100000]}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_input_answers_with_openai_error(client: httpx.AsyncClient, path: str, body: dict, status: int,
                                                   param: str) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert len(error["message"]) > 10
    await assert_healthy(client)


async def test_image_content_parts_are_refused_by_name(client: httpx.AsyncClient) -> None:
    parts = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    response = await client.post(CHAT, json={"messages": [{"role": "user", "content": parts}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content" and "'image_url' are not supported" in error["message"]


@pytest.mark.parametrize(("content", "content_type"), [
    (b"{not json", "application/json"),
    (b'{"prompt": "a"}', "text/plain"),
    (b'["a", "list"]', "application/json"),
    (b"\xff\xfe", "application/json"),
], ids=["malformed json", "wrong content type", "not an object", "not utf-8"])
async def test_malformed_bodies_get_400(client: httpx.AsyncClient, content: bytes, content_type: str) -> None:
    response = await client.post(C, content=content, headers={"content-type": content_type})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    await assert_healthy(client)


async def test_context_errors_give_both_numbers(client: httpx.AsyncClient) -> None:
    error = (await client.post(C, json={"prompt": "x" * 100, "max_tokens": 50})).json()["error"]
    assert "128" in error["message"] and "150" in error["message"] and "100" in error["message"]


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    missing = await client.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = await client.get(C)
    assert wrong.status_code == 405 and "error" in wrong.json()


async def test_harmless_values_of_unsupported_fields_are_accepted(client: httpx.AsyncClient) -> None:
    response = await client.post(C, json={"prompt": "a", "max_tokens": 1, "best_of": 1, "suffix": None,
                                          "user": "me", "logprobs": None})
    assert response.status_code == 200


async def assert_healthy(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    good = await client.post(C, json={"prompt": "ok", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


async def test_the_models_vocabulary_decides_not_the_tokenizers(engine) -> None:
    """The server asks the engine's admission check, which knows the model: an id the tokenizer
    has but the model lacks is refused (the fake tokenizer knows 300 ids; this model 200)."""
    from kvserve.engine.admission import AdmissionCheck

    engine.admission = AdmissionCheck(engine.admission.scheduler_config, 200)
    app = build_app(engine, ServerSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
        error = (await http.post(C, json={"prompt": [5, 250], "max_tokens": 1})).json()["error"]
        assert (error["param"], error["message"]) == ("prompt", "Token id 250 in the prompt is outside the vocabulary [0, 200).")
        assert (await http.post(C, json={"prompt": [5, 199], "max_tokens": 1})).status_code == 200
