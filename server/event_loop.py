"""The server's event loop: uvloop where it is installed, else asyncio's own.

Every streamed token is a few event-loop callbacks (the engine's hand-off, the response body's
send, the socket write), and on a small CPU host they run on the cores the model step needs: an
event loop that costs less per callback is throughput. uvloop (libuv, the loop vLLM's API server
runs on) is a dependency on Linux and macOS; the choice is uvicorn's own `auto` loop, the one
`uvicorn.run` would take. Before Python 3.11 (no asyncio.Runner) asyncio's loop serves.
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
