"""The server's event loop: uvloop where it is installed, else asyncio's own.

Every streamed token is a few event-loop callbacks (the engine's hand-off, the response body's
send, the socket write), and on a small CPU host they run on the cores the model step needs: an
event loop that costs less per callback is throughput. uvloop (libuv, the loop vLLM's API server
runs on) is a dependency on Linux and macOS; elsewhere, or before Python 3.11 (asyncio.Runner),
asyncio's loop serves the same code.
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
