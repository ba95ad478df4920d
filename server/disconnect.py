"""Notices a client that hangs up on a non-streaming request, so its generation is aborted at
once instead of running to max_tokens for nobody. (Streams notice via the SSE response.)"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from kvserve.server.errors import ClientDisconnected

T = TypeVar("T")


async def wait_for_disconnect(request: Request) -> None:
    # The body has been read in full, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Runs `work`; if the client disconnects first, cancels it (aborting its engine requests)
    and raises ClientDisconnected."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
        watcher.cancel()
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()
