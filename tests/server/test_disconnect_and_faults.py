"""Clients that hang up have their requests aborted and are counted as 499, never as server
errors; an engine failure answers everyone with an error (counted as a 500), turns /health to 503
and never hangs."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.app import build_app
from kvserve.server.metrics import ServerMetrics
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL, FakeEngine
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


# ------------------------------------------------------------------ honest error accounting


def error_counts(url: str) -> dict[str, float]:
    """kvserve_request_errors_total by HTTP status, and the 5xx of kvserve_http_requests_total."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "kvserve_request_errors_total":
                counts[sample.labels["code"]] = counts.get(sample.labels["code"], 0) + sample.value
            elif sample.name == "kvserve_http_requests_total" and sample.labels["status"].startswith("5"):
                counts["http_5xx"] = counts.get("http_5xx", 0) + sample.value
    return counts


def metered_app(engine: FakeEngine):
    return build_app(engine, ServerSettings(), metrics=ServerMetrics(MODEL, {}))


def send_raw(address, head: bytes, body: bytes) -> socket.socket:
    sock = socket.create_connection((address.hostname, address.port))
    sock.sendall(head + body)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_client_that_hangs_up_counts_as_499_never_as_a_5xx(stream: bool) -> None:
    engine = FakeEngine(step_delay=0.02)
    with live_server(metered_app(engine)) as url:
        address = urlparse(url)
        body = json.dumps({"prompt": "a", "max_tokens": 100, "stream": stream}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        for _ in range(3):
            with send_raw(address, head, body) as sock:
                if stream:
                    assert sock.recv(1024).startswith(b"HTTP/1.1 200")  # the stream has begun
                wait_until(lambda: bool(engine.active))
            wait_until(lambda: not engine.active)
        wait_until(lambda: error_counts(url).get("499") == 3)
        counts = error_counts(url)
    assert len(engine.aborted) == 3 and engine.finished == []
    assert counts == {"499": 3}, counts


def test_a_client_that_hangs_up_while_sending_its_body_counts_as_499() -> None:
    engine = FakeEngine()
    with live_server(metered_app(engine)) as url:
        address = urlparse(url)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n")
        with send_raw(address, head, b'{"prompt": "a') as sock:
            time.sleep(0.2)  # the route is reading the body when the client leaves
            sock.shutdown(socket.SHUT_RDWR)
        wait_until(lambda: error_counts(url).get("499") == 1)
        assert error_counts(url) == {"499": 1}
        assert httpx.get(f"{url}/health").status_code == 200
    assert engine.started == []


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_an_engine_fault_is_a_500_and_counted_as_one(stream: bool) -> None:
    engine = FakeEngine(step_delay=0.01)
    with live_server(metered_app(engine)) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            def fail_soon() -> None:
                wait_until(lambda: bool(engine.active))
                engine.fail(RuntimeError("injected fault"))

            failer = threading.Thread(target=fail_soon)
            failer.start()
            response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 100, "stream": stream})
            failer.join()
        counts = error_counts(url)
    if stream:  # the 200 had been sent: the fault is an error event, and the access status stays 200
        assert response.status_code == 200 and parse_sse(response.text)[-1]["error"]["code"] == "engine_error"
        assert counts == {}, counts
    else:
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
        assert counts == {"500": 1, "http_5xx": 1}, counts


def test_an_unexpected_error_is_a_500_with_the_error_body_and_the_connection_survives() -> None:
    app = metered_app(FakeEngine())

    @app.get("/raise")
    async def buggy() -> None:
        raise RuntimeError("a bug")

    with live_server(app) as url:
        address = urlparse(url)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        connection.request("GET", "/raise")
        response = connection.getresponse()
        body = json.loads(response.read())
        first_socket = connection.sock
        connection.request("GET", "/health")  # the same keep-alive connection
        health = connection.getresponse()
        health.read()
        assert connection.sock is first_socket and health.status == 200
        counts = error_counts(url)
    assert response.status == 500 and response.getheader("connection") != "close"
    assert body["error"] == {"message": "Internal server error: RuntimeError: a bug", "type": "server_error",
                             "param": None, "code": "internal_error"}
    assert counts == {"500": 1, "http_5xx": 1}
