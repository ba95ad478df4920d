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
MAX_LISTED = 16
MAX_NAME_CHARS = 64
_STATE_KEY = "ignored_fields"


def unknown_fields(body: SamplingFields) -> list[str]:
    """Top-level fields the server neither implements nor knows (OpenAI's no-effect fields such
    as `store` and the known-but-unsupported ones are handled elsewhere)."""
    return sorted(name for name in (body.model_extra or {})
                  if name not in IGNORED_FIELDS and name not in UNSUPPORTED_FIELDS)


def note_ignored_fields(request: Request, body: SamplingFields) -> None:
    note_ignored(request, unknown_fields(body))


def note_ignored(request: Request, names: list[str]) -> None:
    """Logs and reports what the request asked for that this server ignores (field names, or
    e.g. the Responses API's built-in tools)."""
    if names:
        listed = _listed(names)
        logger.warning("%s %s: ignoring what this server does not implement: %s", request.method, request.url.path,
                       listed)
        setattr(request.state, _STATE_KEY, listed)


def _listed(names: list[str]) -> str:
    """The names, the first MAX_LISTED of them (each cut to MAX_NAME_CHARS) and a count of the
    rest: a body of 10,000 made-up fields must not make a log line or a header of 100 KB (HTTP
    clients refuse header lines over 64 KiB)."""
    shown = [name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..." for name in names[:MAX_LISTED]]
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f" (and {rest} more)" if rest else "")


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
                listed = scope.get("state", {}).get(_STATE_KEY)
                if listed:
                    MutableHeaders(scope=message).append(IGNORED_FIELDS_HEADER, _header_safe(listed))
            await send(message)

        await self.app(scope, receive, send_with_header)
