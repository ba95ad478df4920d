"""Clients that hang up have their requests aborted; an engine failure answers everyone with an
error, turns /health to 503 and never hangs."""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlparse

import httpx
import pytest

from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine
from tests.server.live_server import live_server, wait_until
from tests.server.sse import parse_sse


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 100}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 100}),
])
def test_stream_disconnect_aborts_the_request(path: str, body: dict) -> None:
    engine = FakeEngine(step_delay=0.02)
    with live_server(build_app(engine, ServerSettings())) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            with client.stream("POST", path, json={**body, "stream": True}) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
            wait_until(lambda: engine.aborted and not engine.active)
            assert engine.finished == []
            assert client.get("/health").status_code == 200


def test_non_streaming_disconnect_aborts_the_request() -> None:
    engine = FakeEngine(step_delay=0.02)
    with live_server(build_app(engine, ServerSettings())) as url:
        address = urlparse(url)
        body = json.dumps({"prompt": "a", "max_tokens": 100}).encode()
        with socket.create_connection((address.hostname, address.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            wait_until(lambda: bool(engine.active))
        wait_until(lambda: engine.aborted and not engine.active)
        assert engine.finished == []


@pytest.mark.anyio
async def test_engine_failure_errors_in_flight_requests_and_turns_health_503() -> None:
    engine = FakeEngine(step_delay=0.01)
    app = build_app(engine, ServerSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=10) as client:
        plain = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 100}))
        streamed = asyncio.create_task(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 100, "stream": True}))
        while len(engine.active) < 2:
            await asyncio.sleep(0.01)
        engine.fail(RuntimeError("injected GPU fault"))
        plain_response, stream_response = await asyncio.wait_for(asyncio.gather(plain, streamed), timeout=5)
        health = await client.get("/health")
        new = await client.post("/v1/completions", json={"prompt": "a"})
    assert plain_response.status_code == 500
    assert "injected GPU fault" in plain_response.json()["error"]["message"]
    assert plain_response.json()["error"]["code"] == "engine_error"
    chunks = parse_sse(stream_response.text)
    assert chunks[-1]["error"]["code"] == "engine_error"
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert new.status_code == 503 and "restarted" in new.json()["error"]["message"]
