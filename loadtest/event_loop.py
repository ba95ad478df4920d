"""kvserve-bench's event loop: uvloop where it is installed, else asyncio's own.

A load test on the server's own host takes its CPU from the server: per streamed chunk the client
parses HTTP and SSE and decodes JSON, and on uvloop it spent ~30% less CPU for the same stream
(64 streams of W64 against `kvserve serve` on 2 cores: 0.9-1.0 vs 1.3-1.5 CPU s). The choice is
uvicorn's `auto` loop, as the server's (server/event_loop.py, which loadtest may not import: it
measures kvserve and its peers alike). Before Python 3.11 (no asyncio.Runner) asyncio's loop serves.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from uvicorn.loops.auto import auto_loop_factory

T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on the loop uvicorn's `auto` setting picks (uvloop where importable)."""
    if sys.version_info < (3, 11):
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=auto_loop_factory()) as runner:
        return runner.run(main)
