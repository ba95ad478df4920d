"""Per-request HTTP metrics as a pure ASGI middleware (BaseHTTPMiddleware would buffer streams).

A request whose client hung up before the whole response was sent is recorded as 499 (nginx's
"client closed request"), whatever status had been started, so 5xx counts mean server faults.

The route label is the matched route's template ("/v1/completions"), never the raw path, so a
client probing random URLs cannot grow the label set; unmatched paths share one label.
"""

from __future__ import annotations

import time
from typing import Protocol

from starlette.routing import Route

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.engine import EngineLoad
from kvserve.server.errors import CLIENT_CLOSED_REQUEST

UNMATCHED_ROUTE = "unmatched"


class HttpMetrics(Protocol):
    def observe_http(self, route: str, method: str, status: int, duration_s: float) -> None: ...

    def count_error(self, code: int) -> None: ...

    def observe_load(self, load: EngineLoad) -> None: ...

    def render(self) -> tuple[bytes, str]: ...


def route_template(scope: Scope) -> str:
    route = scope.get("route")
    return route.path if isinstance(route, Route) else UNMATCHED_ROUTE  # FastAPI's APIRoute is a Route


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 500  # what the client sees if the app raises before answering
        complete = client_gone = False

        async def receive_and_notice_hang_up() -> Message:
            nonlocal client_gone
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                client_gone = True
            return message

        async def send_and_record_status(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive_and_notice_hang_up, send_and_record_status)
        finally:
            if client_gone:  # hung up before the whole answer (a 200 stream cut short too): not our error
                status = CLIENT_CLOSED_REQUEST
            self.metrics.observe_http(route_template(scope), scope["method"], status, time.monotonic() - start)
            if status >= 400:
                self.metrics.count_error(status)
