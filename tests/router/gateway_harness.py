"""kvserve replicas and SGLang Model Gateway on loopback, for the scale-out tests and benchmark.

Every process listens on 127.0.0.1 only (the gateway's default is 0.0.0.0, its Prometheus
exporter's too: both are overridden), runs in its own process group and is always stopped.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.process_harness import BackgroundProcess, background_process, free_port

VENV_BIN = Path(sys.executable).parent


def gateway_binary() -> str | None:
    """The `sglang-router` launcher of this environment, or None where it is not installed."""
    beside = VENV_BIN / "sglang-router"
    return str(beside) if beside.exists() else shutil.which("sglang-router")


@dataclass
class Replica:
    url: str
    process: BackgroundProcess

    def kill(self) -> None:
        """SIGKILL: a crash, not a drain, so the gateway sees connections refused."""
        self.process.process.kill()
        self.process.process.wait(timeout=30)

    def counters(self) -> dict[str, float]:
        return prometheus_counters(httpx.get(f"{self.url}/metrics", timeout=10, trust_env=False).text)


@contextmanager
def kvserve_replicas(tmp_path: Path, count: int, extra_args: Sequence[str] = ()) -> Iterator[list[Replica]]:
    """`count` replicas of the default model, started together (they load in parallel)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    with ExitStack() as stack:
        replicas = []
        for index in range(count):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            argv = [str(VENV_BIN / "kvserve"), "serve", "--host", "127.0.0.1", "--port", str(port), *extra_args]
            process = stack.enter_context(background_process(argv, tmp_path / f"kvserve-{index}.log",
                                                             f"{url}/health", env=env, startup_timeout_s=300))
            replicas.append(Replica(url, process))
        yield replicas


@contextmanager
def gateway(tmp_path: Path, worker_urls: Sequence[str], policy: str) -> Iterator[str]:
    """The gateway in front of `worker_urls`; yields its base URL once every worker is healthy.
    Health is checked every second and one failure marks a worker down, so a killed replica
    leaves the rotation within seconds (the defaults take much longer)."""
    binary = gateway_binary()
    assert binary is not None, "sglang-router is not installed"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *worker_urls, "--policy", policy,
            "--health-check-endpoint", "/health", "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1", "--log-level", "warn"]
    with background_process(argv, tmp_path / f"gateway-{policy}.log", f"{url}/readiness",
                            startup_timeout_s=60) as running:
        wait_until_workers_healthy(url, len(worker_urls), running)
        yield url


def wait_until_workers_healthy(url: str, count: int, running: BackgroundProcess | None = None,
                               timeout_s: float = 60) -> None:
    """Until the gateway at `url` lists exactly `count` healthy workers (its own health checks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(f"{url}/workers", timeout=5, trust_env=False).json()["workers"]
        if sum(1 for worker in workers if worker["is_healthy"]) == count:
            return
        time.sleep(0.25)
    log = f":\n{running.log_tail()}" if running is not None else ""
    raise AssertionError(f"gateway did not report {count} healthy workers{log}")


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)$")


def prometheus_counters(text: str) -> dict[str, float]:
    """Sums every sample of each metric name (over its labels)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            totals[match["name"]] = totals.get(match["name"], 0.0) + float(match["value"])
    return totals
