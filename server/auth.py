"""API keys (`--api-key`): every route needs the key except the few in `OPEN_PATHS`.

The check is a pure ASGI middleware around the whole app, not a dependency each router opts
into, so a route added later is protected without anyone remembering to ask for it; and it runs
before routing and before the body is read, so a client without the key costs no parsing.

The key travels as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>`
(Anthropic's), and is compared in constant time so response timing leaks nothing about how much
of a guessed key was right.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import unauthorized

# Probes and scrapers carry no key and take no work: load balancers (/health), Prometheus
# (/metrics), version checks; and the API's own description (the same for every kvserve).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                        "/redoc"})


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries, from the first Authorization: Bearer or x-api-key header."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
        if name == b"x-api-key":
            return value.strip()
    return None


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.expected = api_key.encode("utf-8")
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope["headers"])
        if key is None:
            error = unauthorized("Missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key').")
        elif not hmac.compare_digest(key, self.expected):
            error = unauthorized("Incorrect API key provided.")
        else:
            await self.app(scope, receive, send)
            return
        await error.response()(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path as the router matches it: without the root path a proxy may mount us under."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
