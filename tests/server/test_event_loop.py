"""The server's event loop: uvloop when it is installed, asyncio's own when it is not."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kvserve.server.event_loop import run_event_loop


async def loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(sys.platform == "win32" or sys.version_info < (3, 11), reason="uvloop: POSIX, Python 3.11+")
def test_runs_on_uvloop_where_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    assert run_event_loop(loop_module()).startswith("uvloop")


def test_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert run_event_loop(loop_module()).startswith("asyncio")


def test_returns_the_result_and_raises_what_the_coroutine_raises() -> None:
    async def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_event_loop(fail())
    assert run_event_loop(loop_module())  # a fresh loop after a failed one
