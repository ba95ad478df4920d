"""A small HTTP/1.1 client for one thing: POST a JSON body and read the streamed answer line by line.

Why not httpx for the stream: kvserve-bench runs on the machine it measures, and at 64 streams it
handled every streamed chunk in ~100 us of Python in httpx, httpcore, h11 and anyio (profiled on
a 2-core machine: about a second of CPU a run that the server under test would have had). Here a
chunk is one `data_received` call, httptools' C parser (already uvicorn's) and a line split.
What it keeps of a real client: keep-alive connections reused between requests (a fresh
connection when the server closed the idle one), chunked and Content-Length bodies, https, and
distinct errors for an unreachable server, a connection that drops mid-answer and a malformed
response. Redirects, proxies, compression and cookies are not handled: a benchmark talks to one
server it was given directly.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools


class StreamError(Exception):
    """The HTTP exchange failed; subclasses say how."""


class ConnectFailed(StreamError):
    """The server could not be reached (refused, unknown host, TLS handshake failed)."""


class Disconnected(StreamError):
    """The connection closed before the response was complete."""


class BadHttp(StreamError):
    """The server's bytes are not an HTTP/1.x response."""


@dataclass(frozen=True)
class _Origin:
    host: str
    port: int
    tls: bool
    host_header: str  # what the Host header says: the URL's host[:port], IPv6 brackets kept


class _Connection(asyncio.Protocol):
    """One TCP connection; `data_received` feeds the parser, which queues the body for the reader."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser: httptools.HttpResponseParser | None = None
        self._body: collections.deque[bytes] = collections.deque()
        self._headers_done = False
        self._complete = False
        self._received = 0  # bytes of this response so far
        self._framed = False  # a Content-Length or chunked body; otherwise the body ends at EOF
        self._keep_alive = False  # the server will take another request on this connection
        self._error: StreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes between exchanges: the connection cannot be reused
            self._fail(BadHttp(f"unexpected bytes between responses: {data[:80]!r}"))
            return
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(BadHttp(f"malformed HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._parser is not None and not self._complete:
            if self._headers_done and not self._framed and exc is None:  # an EOF-delimited body ends here
                self.on_message_complete()
                return
            self._fail(Disconnected(f"the server closed the connection mid-response ({exc!r})" if exc else
                                    "the server closed the connection mid-response"))

    # -- httptools callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        # Read while the parser still holds this response's headers (it resets after the message).
        self._keep_alive = self._parser is not None and self._framed and self._parser.should_keep_alive()
        self._complete = True
        self._wake()

    # -- the reader's side ---------------------------------------------------------------------
    def start(self, request: bytes) -> None:
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._body.clear()
        self._headers_done = self._complete = self._framed = self._keep_alive = False
        self._received = 0
        self._error = None
        self.transport.write(request)

    async def headers(self) -> int:
        """Wait for the status line and headers; the status code."""
        while not self._headers_done:
            await self._wait()
        assert self._parser is not None
        return int(self._parser.get_status_code())

    async def body_piece(self) -> bytes:
        """The body bytes received since the last call; b"" once the response is complete."""
        while not self._body:
            if self._complete:
                return b""
            await self._wait()
        if len(self._body) == 1:
            return self._body.popleft()
        pieces = b"".join(self._body)
        self._body.clear()
        return pieces

    @property
    def answered(self) -> bool:
        """Whether any byte of the response arrived."""
        return self._received > 0

    @property
    def alive(self) -> bool:
        """Neither side has closed it (or begun to)."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    @property
    def reusable(self) -> bool:
        """Complete, kept alive by the server, and not closed since."""
        return self._complete and self._keep_alive and self.alive

    def finish(self) -> None:
        self._parser = None  # any byte now arriving marks the connection unusable

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: StreamError) -> None:
        if self._error is None:
            self._error = error
        self._wake()
        if self.transport is not None:
            self.transport.close()


class StreamResponse:
    """A response whose headers have arrived; its body is read with `read` or `lines`."""

    def __init__(self, connection: _Connection, status_code: int) -> None:
        self.status_code = status_code
        self._connection = connection

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        pieces = []
        while piece := await self._connection.body_piece():
            pieces.append(piece)
        return b"".join(pieces)

    async def lines(self) -> AsyncIterator[bytes]:
        r"""The body split at b"\n" (a trailing b"\r" removed), the last line even without one."""
        pending = b""
        while piece := await self._connection.body_piece():
            if b"\n" not in piece:
                pending += piece
                continue
            *complete, rest = (pending + piece).split(b"\n")
            pending = rest
            for line in complete:
                yield line[:-1] if line.endswith(b"\r") else line
        if pending:
            yield pending[:-1] if pending.endswith(b"\r") else pending


class StreamClient:
    """Keep-alive connections per origin; no cap on how many (the benchmark sets the concurrency)."""

    def __init__(self, connect_timeout_s: float = 30.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[_Origin, list[_Connection]] = collections.defaultdict(list)
        self._tls: ssl.SSLContext | None = None

    @asynccontextmanager
    async def post(self, url: str, body: bytes, headers: Mapping[str, str] | None = None) -> AsyncIterator[StreamResponse]:
        """POST `body` (JSON) to `url`; the response once its headers are in.

        On leaving the block the connection goes back to the pool only if its whole response has
        arrived and the server keeps it alive; otherwise (an error, a cancelled request, a body
        still arriving) it is closed, so no half-received response is ever reused.
        """
        origin, target = self._split(url)
        request = self._request_bytes(origin, target, body, headers or {})
        connection = await self._exchange(origin, request)
        try:
            yield StreamResponse(connection, await connection.headers())
        except BaseException:
            connection.close()
            raise
        if connection.reusable:
            connection.finish()
            self._idle[origin].append(connection)
        else:
            connection.close()

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _exchange(self, origin: _Origin, request: bytes) -> _Connection:
        idle = self._idle[origin]
        while idle:
            connection = idle.pop()
            if not connection.alive:
                continue
            connection.start(request)
            # An idle connection the server is closing right now (its keep-alive timeout) fails
            # before a single byte of answer: the request was never seen, so send it afresh.
            try:
                await connection.headers()
                return connection
            except Disconnected:
                connection.close()
                if connection.answered:
                    raise
            except BaseException:  # cancelled (the request's timeout) or failed otherwise: never pooled again
                connection.close()
                raise
        connection = await self._connect(origin)
        connection.start(request)
        return connection

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        if origin.tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(_Connection, origin.host, origin.port,
                                       ssl=self._tls if origin.tls else None),
                timeout=self.connect_timeout_s)
        except (OSError, ssl.SSLError) as e:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {e}") from e
        except asyncio.TimeoutError as e:
            raise ConnectFailed(f"no connection to {origin.host}:{origin.port} within {self.connect_timeout_s} s") from e
        return connection

    @staticmethod
    def _split(url: str) -> tuple[_Origin, str]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"need an http:// or https:// URL with a host, got {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host_header = parts.netloc.rpartition("@")[2]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return _Origin(parts.hostname, port, tls, host_header), target

    @staticmethod
    def _request_bytes(origin: _Origin, target: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        lines = [f"POST {target} HTTP/1.1", f"Host: {origin.host_header}", "Content-Type: application/json",
                 "Accept: text/event-stream", f"Content-Length: {len(body)}"]
        for name, value in headers.items():
            if "\r" in name + value or "\n" in name + value:
                raise ValueError(f"header {name!r} has a line break")
            lines.append(f"{name}: {value}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
