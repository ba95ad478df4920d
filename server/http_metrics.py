"""Per-request HTTP metrics as a pure ASGI middleware (BaseHTTPMiddleware would buffer streams).

The route label is the matched route's template ("/v1/completions"), never the raw path, so a
client probing random URLs cannot grow the label set; unmatched paths share one label.
"""

from __future__ import annotations

import time
from typing import Protocol

from starlette.routing import Route

from kvserve.engine.stats import EngineLoad
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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

        async def send_and_record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record_status)
        finally:
            self.metrics.observe_http(route_template(scope), scope["method"], status, time.monotonic() - start)
            if status >= 400:
                self.metrics.count_error(status)
