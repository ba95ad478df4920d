"""API-key check for /v1/*: `Authorization: Bearer <key>`, compared in constant time so response
timing leaks nothing about how much of a guessed key was right."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request

from kvserve.server.errors import unauthorized


def api_key_dependency(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode("utf-8")

    async def require_api_key(request: Request) -> None:
        header = request.headers.get("authorization")
        if header is None:
            raise unauthorized("Missing API key: send the header 'Authorization: Bearer <key>'.")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8"), expected):
            raise unauthorized("Incorrect API key provided.")

    return require_api_key
