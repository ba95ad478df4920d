"""kvserve-bench's event loop: uvloop where it is installed, else asyncio's own.

A load test on the server's own host takes its CPU from the server: per streamed chunk the client
parses HTTP and SSE and decodes JSON, and on uvloop it spent ~30% less CPU for the same stream
(64 streams of W64 against `kvserve serve` on 2 cores: 0.9-1.0 vs 1.3-1.5 CPU s). Its own copy of
the server's loop choice (server/event_loop.py): loadtest imports nothing else of kvserve, so it
measures kvserve and its peers alike.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on a uvloop loop where uvloop is importable."""
    if sys.version_info >= (3, 11):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)
