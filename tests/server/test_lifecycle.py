"""Loading and draining: /health is not-ready, new work gets 503 + Retry-After, in-flight
requests finish within the grace period and the rest end with finish_reason "abort"."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve.server.app import build_app, serving_state
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine
from tests.server.sse import parse_sse

pytestmark = pytest.mark.anyio


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=10)


async def test_loading_then_ready() -> None:
    app = build_app(None, ServerSettings())
    async with client_for(app) as client:
        loading = await client.get("/health")
        refused = await client.post("/v1/completions", json={"prompt": "a"})
        serving_state(app).attach_engine(FakeEngine())
        ready = await client.get("/health")
        served = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert loading.status_code == 503 and loading.json()["status"] == "loading"
    assert refused.status_code == 503 and "loading" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"
    assert ready.status_code == 200 and served.status_code == 200


async def test_drain_lets_in_flight_requests_finish_and_refuses_new_ones() -> None:
    engine = FakeEngine(step_delay=0.01)
    app = build_app(engine, ServerSettings())
    state = serving_state(app)
    async with client_for(app) as client:
        running = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 20,
                                                                           "stream": True}))
        while not engine.active:
            await asyncio.sleep(0.01)
        drain = asyncio.create_task(state.drain(grace_period_s=5))
        await asyncio.sleep(0.02)
        health = await client.get("/health")
        refused = await client.post("/v1/completions", json={"prompt": "a"})
        assert await asyncio.wait_for(drain, 5) is True
        response = await running
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    chunks = parse_sse(response.text)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert engine.aborted == []


async def test_grace_period_over_aborts_with_clean_finish_reason() -> None:
    engine = FakeEngine(step_delay=0.01)
    app = build_app(engine, ServerSettings())
    state = serving_state(app)
    async with client_for(app) as client:
        streamed = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 100, "n": 2, "stream": True}))
        plain = asyncio.create_task(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 100}))
        while len(engine.active) < 2:
            await asyncio.sleep(0.01)
        assert await asyncio.wait_for(state.drain(grace_period_s=0.05), 5) is False
        stream_response, plain_response = await asyncio.gather(streamed, plain)
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in parse_sse(stream_response.text) if c["choices"][0]["finish_reason"]}
    assert finishes == {0: "abort", 1: "abort"}
    assert plain_response.status_code == 200
    assert plain_response.json()["choices"][0]["finish_reason"] == "abort"
    assert not engine.active and len(engine.aborted) == 2
    assert state.in_flight_requests == 0
