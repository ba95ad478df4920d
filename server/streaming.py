"""Server-sent events: `data: {json}\\n\\n` per chunk and `data: [DONE]` at the end, as OpenAI
streams. The response class guarantees cleanup however the stream ends (finished, failed, or the
client hung up before or during it), because a generator that never started never runs `finally`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, ensure_ascii=False)
    return f"data: {body}\n\n"


def named_sse_event(payload: dict[str, Any]) -> str:
    """An event with its `event:` line, as the Responses and Messages APIs stream (Anthropic's
    clients dispatch on it): the name is the payload's `type`."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A client that disconnects while the generator waits at `yield` leaves it suspended;
            # closing it runs its cleanup now (aborting the engine requests) instead of at GC.
            try:
                await self._events.aclose()
            finally:
                self._on_close()
