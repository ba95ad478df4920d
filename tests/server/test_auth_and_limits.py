"""API keys on every route that takes work, per-request caps, body size and the queue limit."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import APIRouter, FastAPI

from kvserve.server.app import build_app
from kvserve.server.auth import OPEN_PATHS
from kvserve.server.limits import ServerLimits
from kvserve.server.metrics import ServerMetrics
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL, FakeEngine

pytestmark = pytest.mark.anyio

KEY = "sk-test-123"


def client_for(engine: FakeEngine, settings: ServerSettings) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, settings)),
                             base_url="http://testserver", timeout=10)


@pytest.mark.parametrize("path,method,body", [
    ("/v1/completions", "POST", {"prompt": "a", "max_tokens": 1}),
    ("/v1/chat/completions", "POST", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
    ("/v1/models", "GET", None),
    ("/tokenize", "POST", {"prompt": "a"}),
    ("/detokenize", "POST", {"tokens": [1]}),
    ("/tokenizer_info", "GET", None),
])
async def test_routes_that_take_work_need_the_key(path: str, method: str, body: dict | None) -> None:
    async with client_for(FakeEngine(), ServerSettings(api_key=KEY)) as client:
        missing = await client.request(method, path, json=body)
        wrong = await client.request(method, path, json=body, headers={"Authorization": "Bearer sk-wrong"})
        not_bearer = await client.request(method, path, json=body, headers={"Authorization": f"Basic {KEY}"})
        empty = await client.request(method, path, json=body, headers={"Authorization": "Bearer "})
        wrong_x = await client.request(method, path, json=body, headers={"x-api-key": KEY[:-1]})
        right = await client.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        right_x = await client.request(method, path, json=body, headers={"x-api-key": KEY})  # Anthropic's clients
    for response in (missing, wrong, not_bearer, empty, wrong_x):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert right.status_code == 200 and right_x.status_code == 200


def app_routes(app: FastAPI) -> list[tuple[str, str]]:
    """Every API route (path, METHOD), from the app's own OpenAPI document."""
    return [(path, method.upper()) for path, operations in app.openapi()["paths"].items() for method in operations]


async def test_every_route_but_the_open_ones_needs_the_key_including_routers_added_later() -> None:
    app = build_app(FakeEngine(), ServerSettings(api_key=KEY), metrics=ServerMetrics(MODEL, {}))
    later = APIRouter()  # what a new server module adds: it is protected without asking

    @later.post("/v1/added_later")
    async def added_later() -> dict[str, bool]:
        return {"ran": True}

    app.include_router(later)
    routes = app_routes(app)
    assert {"/tokenize", "/detokenize", "/tokenizer_info", "/server_info", "/v1/added_later"} <= {p for p, _ in routes}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=10) as client:
        for path, method in routes:
            response = await client.request(method, path)
            if path in OPEN_PATHS:
                assert response.status_code == 200, (path, response.text)
            else:
                assert response.status_code == 401, (path, method, response.status_code)
        for path in ("/no/such/route", "/health/", "/HEALTH"):  # not open: near misses of open paths
            assert (await client.get(path)).status_code == 401, path
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await client.get(path)).status_code == 200, path
        metrics = (await client.get("/metrics")).text
    assert 'kvserve_request_errors_total{code="401",model_name="fake-model"}' in metrics


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
