"""Unknown request fields are ignored, as vLLM does, not rejected: gateways and load testers add
their own (SGLang's router sends `no_stop_trim`, others `chat_template_kwargs` spellings we do
not know), and a 400 for every such request makes the server unusable behind them.

Ignoring silently would hide typos, so each request that had some logs one warning line, and its
response lists them in the `X-Ignored-Fields` header. The route records the names on
`request.state`; a pure ASGI middleware (which, unlike BaseHTTPMiddleware, does not buffer
streams) copies them into the response's headers.
"""

from __future__ import annotations

import logging

from fastapi import Request
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.protocol import IGNORED_FIELDS, UNSUPPORTED_FIELDS, SamplingFields

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
_STATE_KEY = "ignored_fields"


def unknown_fields(body: SamplingFields) -> list[str]:
    """Top-level fields the server neither implements nor knows (OpenAI's no-effect fields such
    as `store` and the known-but-unsupported ones are handled elsewhere)."""
    return sorted(name for name in (body.model_extra or {})
                  if name not in IGNORED_FIELDS and name not in UNSUPPORTED_FIELDS)


def note_ignored_fields(request: Request, body: SamplingFields) -> None:
    names = unknown_fields(body)
    if names:
        logger.warning("%s %s: ignoring unknown request fields: %s", request.method, request.url.path,
                       ", ".join(names))
        setattr(request.state, _STATE_KEY, names)


def _header_safe(text: str) -> str:
    """Field names are the client's JSON keys: anything but printable ASCII (non-Latin letters,
    CR/LF that would split the header) is escaped as \\uXXXX so the response can always be sent."""
    return "".join(c if " " <= c <= "~" else f"\\u{ord(c):04x}" for c in text)


class IgnoredFieldsHeaderMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = scope.get("state", {}).get(_STATE_KEY)
                if names:
                    MutableHeaders(scope=message).append(IGNORED_FIELDS_HEADER, _header_safe(", ".join(names)))
            await send(message)

        await self.app(scope, receive, send_with_header)
