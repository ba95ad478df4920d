"""A scripted HTTP server on 127.0.0.1 for the stream client's tests: it writes exactly the bytes a
test gives it (well-formed or not), in the pieces given, and records what it received.

`answer(request_index, request_body)` returns the response as a list of byte pieces, each written
and flushed on its own (so a line can arrive split across reads), or None to close the connection
without answering. The connection is closed after the answer unless `keep_alive` is set.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

Answer = Callable[[int, bytes], "list[bytes] | None"]


def chunked(status: int, *pieces: bytes, content_type: str = "text/event-stream") -> list[bytes]:
    """A chunked response: headers, then each piece as one chunk (its own write), then the end."""
    head = f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    return [head] + [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p] + [b"0\r\n\r\n"]


def sized(status: int, body: bytes, content_type: str = "application/json") -> list[bytes]:
    head = f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
    return [head, body]


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


@dataclass
class RawHttpServer:
    answer: Answer
    keep_alive: bool = False
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)  # (head, body) of each request
    connections: int = 0
    port: int = 0
    _server: asyncio.AbstractServer | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RawHttpServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):  # idle keep-alive connections too
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                index = len(self.requests)
                self.requests.append((head, body))
                pieces = self.answer(index, body)
                if pieces is None:
                    return
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                if not self.keep_alive:
                    return
        finally:
            self._handlers.discard(task)
            self._writers.discard(writer)
            writer.close()
