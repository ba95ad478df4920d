"""Background processes for tests (kvserve servers, Prometheus): started in their own process
group, waited for until an HTTP URL answers 200, always stopped (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class BackgroundProcess:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


@contextmanager
def background_process(
    argv: Sequence[str],
    log_path: Path,
    ready_url: str,
    *,
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 240.0,
    stop_timeout_s: float = 30.0,
) -> Iterator[BackgroundProcess]:
    """Runs argv with output to log_path; yields once GET ready_url answers 200. Fails with the
    log's tail when the process exits first or the deadline passes."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(list(argv), env=None if env is None else dict(env), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    running = BackgroundProcess(process, log_path)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise AssertionError(f"{argv[0]} exited with {process.returncode} before {ready_url} answered:\n"
                                     f"{running.log_tail()}")
            try:
                if httpx.get(ready_url, timeout=2.0, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{ready_url} not 200 within {startup_timeout_s} s:\n{running.log_tail()}")
            time.sleep(0.25)
        yield running
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
