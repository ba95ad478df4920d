"""API keys on /v1/*, per-request caps, body size and the queue limit."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve.server.app import build_app
from kvserve.server.limits import ServerLimits
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

KEY = "sk-test-123"


def client_for(engine: FakeEngine, settings: ServerSettings) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, settings)),
                             base_url="http://testserver", timeout=10)


@pytest.mark.parametrize("path,method,body", [
    ("/v1/completions", "POST", {"prompt": "a", "max_tokens": 1}),
    ("/v1/chat/completions", "POST", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
    ("/v1/models", "GET", None),
])
async def test_v1_routes_need_the_key(path: str, method: str, body: dict | None) -> None:
    async with client_for(FakeEngine(), ServerSettings(api_key=KEY)) as client:
        missing = await client.request(method, path, json=body)
        wrong = await client.request(method, path, json=body, headers={"Authorization": "Bearer sk-wrong"})
        not_bearer = await client.request(method, path, json=body, headers={"Authorization": f"Basic {KEY}"})
        right = await client.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    for response in (missing, wrong, not_bearer):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert right.status_code == 200


async def test_operational_routes_need_no_key() -> None:
    async with client_for(FakeEngine(), ServerSettings(api_key=KEY)) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/version")).status_code == 200


def limited(**caps: int) -> ServerSettings:
    return ServerSettings(limits=ServerLimits(**caps))


@pytest.mark.parametrize("caps,body,param", [
    ({"max_n": 2}, {"prompt": "a", "n": 3}, "n"),
    ({"max_logprobs": 2}, {"prompt": "a", "logprobs": 3}, "logprobs"),
    ({"max_stop_strings": 2}, {"prompt": "a", "stop": ["x", "y", "z"]}, "stop"),
    ({"max_stop_string_length": 4}, {"prompt": "a", "stop": "abcdef"}, "stop"),
    ({"max_tokens": 8}, {"prompt": "a", "max_tokens": 9}, "max_tokens"),
    ({"max_prompts_per_request": 2}, {"prompt": ["a", "b", "c"]}, "prompt"),
    ({"max_logit_bias": 1}, {"prompt": "a", "logit_bias": {"1": 1, "2": 1}}, "logit_bias"),
])
async def test_caps_answer_400_naming_the_field(caps: dict, body: dict, param: str) -> None:
    async with client_for(FakeEngine(), limited(**caps)) as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_chat_top_logprobs_cap_names_top_logprobs() -> None:
    async with client_for(FakeEngine(), limited(max_logprobs=2)) as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


async def test_oversized_body_gets_413_with_or_without_content_length() -> None:
    async with client_for(FakeEngine(), limited(max_body_bytes=1000)) as client:
        declared = await client.post("/v1/completions", json={"prompt": "x" * 2000})

        async def chunked():
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'

        streamed = await client.post("/v1/completions", content=chunked(),
                                     headers={"content-type": "application/json"})
        assert (await client.get("/health")).status_code == 200
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"


async def test_full_queue_gets_503_with_retry_after_and_recovers() -> None:
    engine = FakeEngine(max_num_seqs=2)
    engine.gate = asyncio.Event()
    settings = ServerSettings(max_queued_requests=1)  # capacity: 2 running + 1 waiting sequences
    async with client_for(engine, settings) as client:
        held = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}))
                for _ in range(3)]
        while len(engine.started) < 3:
            await asyncio.sleep(0.01)
        rejected = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        too_big = await client.post("/v1/completions", json={"prompt": "a", "n": 4, "max_tokens": 1})
        engine.gate.set()
        assert all(r.status_code == 200 for r in await asyncio.gather(*held))
        after = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert rejected.status_code == 503 and rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["type"] == "server_error"
    assert too_big.status_code == 400  # can never fit: retrying would not help
    assert after.status_code == 200
