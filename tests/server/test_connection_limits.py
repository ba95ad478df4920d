"""The connection cap and the header timeout, with real sockets against a real uvicorn configured
as `kvserve serve` configures it (serve.uvicorn_config): half-sent headers are closed, a
connection over the cap is answered 503 at once, and normal requests keep being served."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.app import build_app
from kvserve.server.connection_guard import MAX_HEADER_BYTES
from kvserve.server.metrics import ServerMetrics
from kvserve.server.serve import uvicorn_config
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL, FakeEngine
from tests.server.live_server import live_server

HEADER_TIMEOUT_S = 0.5
# Generous for a loaded 2-core machine: the point is that the connection is closed at all.
CLOSE_WITHIN_S = HEADER_TIMEOUT_S + 10


@contextmanager
def guarded_server(max_connections: int) -> Iterator[tuple[str, tuple[str, int]]]:
    settings = ServerSettings(port=0, log_level="warning", max_connections=max_connections,
                              header_timeout=HEADER_TIMEOUT_S)
    metrics = ServerMetrics(MODEL, {})
    app = build_app(FakeEngine(), settings, metrics=metrics)
    with live_server(app, uvicorn_config(app, settings, metrics)) as url:
        address = urlparse(url)
        yield url, (address.hostname, address.port)


def read_until_closed(sock: socket.socket, timeout_s: float = CLOSE_WITHIN_S) -> bytes:
    """Everything the server sends until it closes the connection; fails if it does not."""
    sock.settimeout(timeout_s)
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


def read_response(sock: socket.socket) -> bytes:
    """One whole /health response (headers and its body)."""
    sock.settimeout(10)
    received = b""
    while b'{"status":"ok"}' not in received:
        chunk = sock.recv(4096)
        assert chunk, f"closed after {received!r}"
        received += chunk
    return received


def refused(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "kvserve_http_connections_refused_total"}


@pytest.mark.parametrize("sent", [
    b"",  # connected, silent
    b"POST /v1/comp",  # half a request line
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",  # no blank line
], ids=["silent", "half a request line", "headers without their end"])
def test_headers_not_sent_in_time_close_the_connection(sent: bytes) -> None:
    with guarded_server(max_connections=64) as (url, address):
        with socket.create_connection(address) as sock:
            sock.sendall(sent)
            started = time.monotonic()
            answer = read_until_closed(sock)
            waited = time.monotonic() - started
        assert waited >= HEADER_TIMEOUT_S * 0.9
        assert answer == (b"" if not sent else answer)
        if sent:
            assert answer.startswith(b"HTTP/1.1 408")
        assert refused(url) == {"connection_limit": 0, "header_timeout": 1, "headers_too_large": 0}
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_keep_alive_connection_that_stalls_inside_its_next_request_is_closed() -> None:
    with guarded_server(max_connections=64) as (url, address):
        with socket.create_connection(address) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /health HTTP/1.1\r\nHos")  # the second request stops mid-header
            assert read_until_closed(sock).startswith(b"HTTP/1.1 408")
        assert refused(url)["header_timeout"] == 1


@pytest.mark.parametrize("first_request", [False, True], ids=["first request", "after a keep-alive response"])
def test_headers_beyond_the_cap_get_431_and_a_close(first_request: bool) -> None:
    with guarded_server(max_connections=64) as (url, address):
        with socket.create_connection(address) as sock:
            if first_request:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_response(sock).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
            try:  # the server closes mid-way: what it read so far is its whole memory cost
                for _ in range(MAX_HEADER_BYTES // len(line) * 4):
                    sock.sendall(line)
            except OSError:
                pass
            try:
                answer = read_until_closed(sock)
            except ConnectionResetError:  # closed while our bytes were unread: the kernel resets
                answer = b""
            assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:100]
        assert refused(url)["headers_too_large"] == 1
        # Headers within the cap are served.
        padded = httpx.get(f"{url}/health", headers={"X-Pad": "a" * (MAX_HEADER_BYTES // 2)})
        assert padded.status_code == 200


def test_a_slow_but_timely_request_is_served() -> None:
    with guarded_server(max_connections=64) as (_, address):
        with socket.create_connection(address) as sock:
            for piece in (b"GET /hea", b"lth HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
                sock.sendall(piece)
                time.sleep(HEADER_TIMEOUT_S / 8)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
            # Idle after a response, the keep-alive timer (not ours) governs; a new request works.
            time.sleep(HEADER_TIMEOUT_S * 1.5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200")


def test_slowloris_half_open_connections_are_refused_over_the_cap_then_timed_out() -> None:
    cap = 16
    with guarded_server(max_connections=cap) as (url, address):
        half_open = []
        try:
            for _ in range(cap):  # fill the cap with half-sent headers
                sock = socket.create_connection(address)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                half_open.append(sock)
            time.sleep(0.1)  # let the server register them
            over = []
            for _ in range(34):  # 50 in all: every one past the cap is answered at once and closed
                sock = socket.create_connection(address)
                over.append(read_until_closed(sock, timeout_s=5))
                sock.close()
            assert all(answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer
                       and b"too_many_connections" in answer for answer in over)
            # The half-open ones are closed by the header timeout, which frees the cap.
            assert all(read_until_closed(sock).startswith(b"HTTP/1.1 408") for sock in half_open)
        finally:
            for sock in half_open:
                sock.close()
        deadline = time.monotonic() + 10
        while True:  # the server notices the closes shortly after the client does
            response = httpx.get(f"{url}/health")
            if response.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert response.status_code == 200
        counts = refused(url)
        assert counts == {"connection_limit": 34, "header_timeout": cap, "headers_too_large": 0}, counts
