"""Bounds on HTTP connections, below the ASGI app, so that half-open connections cannot exhaust
the process's file descriptors (slowloris: open many connections, send headers slowly or never).

- A cap on open connections (`--max-connections`): a connection beyond it is answered 503 with
  Retry-After and closed at once, so it holds its descriptor for microseconds.
- A header timeout (`--header-timeout`): a connection must finish a request's headers within
  that many seconds of connecting, or of its first byte after an idle keep-alive pause; otherwise
  it is answered 408 (if it had sent part of a request) and closed. uvicorn has no such timer:
  its keep-alive timeout covers only silence between requests.
- A cap on a request's header bytes (`MAX_HEADER_BYTES`): beyond it, 431 and the connection is
  closed (the parser would otherwise hold every header line sent).

Both live in a subclass of the HTTP protocol uvicorn would use (httptools, else h11), made by
`guarded_protocol`. They rely on what both implementations keep: `connections` (the server's
set of open protocols), `cycle` (the request whose headers were parsed last; replaced when the
next request's headers are complete) and `transport`.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

REFUSED_LIMIT = "connection_limit"
REFUSED_HEADER_TIMEOUT = "header_timeout"
REFUSED_HEADERS_TOO_LARGE = "headers_too_large"
# A request's line and headers at most (nginx's large_client_header_buffers is 4 x 8 KiB): the
# HTTP parser keeps whatever headers arrive, so without a cap one connection could send
# gigabytes of them within the header timeout.
MAX_HEADER_BYTES = 64 * 1024
# Descriptors the process needs besides its connections: the model's files, logs, the
# tensor-parallel workers' sockets, the event loop's own.
RESERVED_DESCRIPTORS = 128

_SERVICE_UNAVAILABLE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                        b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s")
_BUSY_BODY = (b'{"error": {"message": "The server has reached its limit of open connections '
              b'(--max-connections); retry shortly.", "type": "server_error", "param": null, '
              b'"code": "too_many_connections"}}')
_HEADERS_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                      b"content-length: 0\r\n\r\n")
_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float


class ConnectionListener(Protocol):
    def on_connection_refused(self, reason: str) -> None: ...

    def on_open_connections(self, count: int) -> None: ...


def guarded_protocol(base: type[asyncio.Protocol], limits: ConnectionLimits,
                     listener: ConnectionListener | None = None) -> type[asyncio.Protocol]:
    """`base` (uvicorn's HttpToolsProtocol or H11Protocol) with the cap and the header timer."""

    class GuardedProtocol(base):  # type: ignore[valid-type, misc]
        _header_timer: asyncio.TimerHandle | None = None
        _awaited: Any = None  # the `cycle` that was current when the timer was armed
        _request_begun = False  # some bytes of the awaited request have arrived
        _header_bytes = 0  # bytes received while the awaited request's headers are unfinished
        _refused = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refused = True
                transport.write(_SERVICE_UNAVAILABLE % (len(_BUSY_BODY), _BUSY_BODY))  # type: ignore[attr-defined]
                transport.close()
                _notify_refused(listener, REFUSED_LIMIT)
                return
            _notify_open(listener, len(self.connections))
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            between_requests = self.cycle is None or self.cycle.response_complete
            before = self.cycle
            self._request_begun = True
            super().data_received(data)
            if self._header_timer is not None:
                if self.cycle is not self._awaited:  # the request's headers are complete
                    self._cancel_header_timer()
                    return
            elif between_requests and self.cycle is before and not self.transport.is_closing():
                self._arm_header_timer()  # after a keep-alive pause, a request begun but unfinished
                self._request_begun = True
            else:
                return
            self._header_bytes += len(data)  # still in the headers: the parser keeps them all
            if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                self._cancel_header_timer()
                self.transport.write(_HEADERS_TOO_LARGE)
                self.transport.close()
                _notify_refused(listener, REFUSED_HEADERS_TOO_LARGE)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)
            if not self._refused:
                _notify_open(listener, len(self.connections))

        def _arm_header_timer(self) -> None:
            self._awaited = self.cycle
            self._request_begun = False
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is not self._awaited or self.transport.is_closing() \
                    or self.transport.get_protocol() is not self:  # upgraded (WebSocket): not ours now
                return
            if self._request_begun:  # a connection that never sent a byte is just closed
                self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()
            _notify_refused(listener, REFUSED_HEADER_TIMEOUT)

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol


def _notify_refused(listener: ConnectionListener | None, reason: str) -> None:
    logger.debug("closed a connection: %s", reason)
    if listener is not None:
        listener.on_connection_refused(reason)


def _notify_open(listener: ConnectionListener | None, count: int) -> None:
    if listener is not None:
        listener.on_open_connections(count)


def ensure_descriptors(max_connections: int, warn: Callable[[str], None] = logger.warning) -> None:
    """Raises the soft RLIMIT_NOFILE toward the hard limit so that the connection cap can be
    reached, and warns if even the hard limit is too low (the cap then cannot protect us)."""
    needed = max_connections + RESERVED_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        warn(f"--max-connections {max_connections} needs about {needed} file descriptors but this process may "
             f"open {soft} (ulimit -n): lower --max-connections or raise the limit")
