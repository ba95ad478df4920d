"""The load test's HTTP client: keep-alive reuse, fresh connections where reuse is unsafe, body framing."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from kvserve.loadtest.http_stream import ConnectFailed, Disconnected, StreamClient

from .raw_http_server import Answer, RawHttpServer, chunked, sized

T = TypeVar("T")


def with_server(answer: Answer, keep_alive: bool,
                body: Callable[[RawHttpServer, StreamClient], Awaitable[T]]) -> tuple[T, RawHttpServer]:
    async def go() -> tuple[T, RawHttpServer]:
        async with RawHttpServer(answer, keep_alive=keep_alive) as server, StreamClient() as http:
            return await body(server, http), server

    return asyncio.run(go())


async def post_lines(http: StreamClient, url: str) -> tuple[int, list[bytes]]:
    async with http.post(url + "/v1/completions", b"{}") as response:
        return response.status_code, [line async for line in response.lines()]


def test_a_kept_alive_connection_is_reused_for_the_next_request() -> None:
    async def two(server: RawHttpServer, http: StreamClient) -> list[tuple[int, list[bytes]]]:
        return [await post_lines(http, server.base_url) for _ in range(2)]

    results, server = with_server(lambda i, body: chunked(200, b"a\nb", b"c\n"), True, two)
    assert results == [(200, [b"a", b"bc"])] * 2
    assert server.connections == 1 and len(server.requests) == 2


def test_a_connection_the_server_closed_is_not_reused() -> None:
    async def two(server: RawHttpServer, http: StreamClient) -> list[tuple[int, list[bytes]]]:
        first = await post_lines(http, server.base_url)
        await asyncio.sleep(0.05)  # the server's close reaches the client
        return [first, await post_lines(http, server.base_url)]

    results, server = with_server(lambda i, body: chunked(200, b"x\n"), False, two)
    assert results == [(200, [b"x"])] * 2 and server.connections == 2


def test_a_request_on_an_idle_connection_closed_unanswered_is_sent_again_on_a_new_one() -> None:
    # The race of a server's keep-alive timeout: the reused connection closes before any answer.
    def answer(i: int, body: bytes) -> list[bytes] | None:
        return None if i == 1 else chunked(200, b"ok %d\n" % i)

    async def two(server: RawHttpServer, http: StreamClient) -> list[tuple[int, list[bytes]]]:
        return [await post_lines(http, server.base_url) for _ in range(2)]

    results, server = with_server(answer, True, two)
    assert results == [(200, [b"ok 0"]), (200, [b"ok 2"])]
    assert server.connections == 2 and len(server.requests) == 3


def test_a_first_connection_closed_unanswered_is_an_error_not_a_retry() -> None:
    async def one(server: RawHttpServer, http: StreamClient) -> None:
        with pytest.raises(Disconnected):
            await post_lines(http, server.base_url)

    _, server = with_server(lambda i, body: None, True, one)
    assert len(server.requests) == 1


def test_a_response_left_half_read_closes_its_connection() -> None:
    async def partial_then_full(server: RawHttpServer, http: StreamClient) -> tuple[int, list[bytes]]:
        async with http.post(server.base_url + "/v1/completions", b"{}") as response:
            async for _ in response.lines():
                break  # stop reading after the first line: the rest is still in flight
        return await post_lines(http, server.base_url)

    def answer(i: int, body: bytes) -> list[bytes]:  # the first answer stops before its end
        return chunked(200, b"one\n", b"two\n")[: 2 if i == 0 else None]

    result, server = with_server(answer, True, partial_then_full)
    assert result == (200, [b"one", b"two"]) and server.connections == 2


def test_an_error_inside_the_block_closes_the_connection_and_propagates() -> None:
    async def failing(server: RawHttpServer, http: StreamClient) -> tuple[int, list[bytes]]:
        with pytest.raises(KeyError):
            async with http.post(server.base_url + "/v1/completions", b"{}"):
                raise KeyError("caller's own error")
        return await post_lines(http, server.base_url)

    result, server = with_server(lambda i, body: chunked(200, b"z\n"), True, failing)
    assert result == (200, [b"z"]) and server.connections == 2


def test_sized_and_eof_delimited_bodies_are_read_whole() -> None:
    async def read_both(server: RawHttpServer, http: StreamClient) -> list[bytes]:
        bodies = []
        for _ in range(2):
            async with http.post(server.base_url + "/x", b'{"a": 1}', {"X-Test": "1"}) as response:
                bodies.append(await response.read())
        return bodies

    def answer(i: int, body: bytes) -> list[bytes]:
        if i == 0:
            return sized(400, b'{"error": "bad"}')
        return [b"HTTP/1.1 200 X\r\nconnection: close\r\n\r\n", b"no length, ", b"ends at close"]

    bodies, server = with_server(answer, False, read_both)
    assert bodies == [b'{"error": "bad"}', b"no length, ends at close"]
    head, body = server.requests[0]
    assert body == b'{"a": 1}' and b"\r\nContent-Length: 8\r\n" in head and b"\r\nX-Test: 1\r\n" in head


def test_bad_urls_and_headers_are_refused_before_sending() -> None:
    async def go() -> None:
        async with StreamClient(connect_timeout_s=1) as http:
            for url in ("ftp://h/x", "http:///x"):
                with pytest.raises(ValueError, match="http"):
                    async with http.post(url, b""):
                        pass
            with pytest.raises(ValueError, match="line break"):
                async with http.post("http://127.0.0.1:1/x", b"", {"X": "a\r\nInjected: 1"}):
                    pass
            with pytest.raises(ConnectFailed):
                async with http.post("http://127.0.0.1:1/x", b""):
                    pass

    asyncio.run(go())
