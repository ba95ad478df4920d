"""deploy/router/run_local.sh: replicas + gateway come up, every replica serves through the
gateway, and one signal stops them all. Replicas are the fake engine behind the real server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.process_harness import free_port
from tests.router.gateway_harness import gateway_binary
from tests.server.fake_engine import MODEL

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "router" / "run_local.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.router,
    pytest.mark.skipif(gateway_binary() is None, reason="sglang-router is not installed (pip install -e '.[dev]')"),
]


def _fake_kvserve(tmp_path: Path) -> Path:
    wrapper = tmp_path / "kvserve"
    wrapper.write_text(f"#!/bin/sh\ncd {REPO} && exec {sys.executable} -m tests.router.fake_kvserve \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def _completions_served(replica_url: str) -> int:
    text = httpx.get(f"{replica_url}/metrics", timeout=5, trust_env=False).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("kvserve_http_requests_total{") and 'route="/v1/completions"' in line)


def test_script_starts_replicas_behind_the_gateway_and_stops_them(tmp_path: Path) -> None:
    gateway_port, base_port = free_port(), free_port()
    env = dict(os.environ, GATEWAY_PORT=str(gateway_port), GATEWAY_METRICS_PORT=str(free_port()),
               BASE_PORT=str(base_port), RUN_DIR=str(tmp_path / "run"), KVSERVE=str(_fake_kvserve(tmp_path)),
               SGLANG_ROUTER=str(gateway_binary()), THREADS_PER_REPLICA="1")
    script = subprocess.Popen(["bash", str(SCRIPT), "-n", "2", "-p", "round_robin"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{gateway_port}"
        deadline = time.monotonic() + 120
        while True:
            assert script.poll() is None, script.stdout.read().decode() if script.stdout else ""
            try:
                workers = httpx.get(f"{url}/workers", timeout=2, trust_env=False).json()["workers"]
                if len(workers) == 2 and all(worker["is_healthy"] for worker in workers):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the gateway did not come up"
            time.sleep(0.5)
        # The probes gave the gateway the served model's name.
        assert {worker["model_id"] for worker in workers} == {MODEL}
        for _ in range(4):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=30, trust_env=False)
            assert response.status_code == 200, response.text
        replica_urls = [f"http://127.0.0.1:{base_port + i}" for i in range(2)]
        served = [_completions_served(u) for u in replica_urls]
        assert served == [2, 2]  # round robin

        pids = [int((tmp_path / "run" / f"kvserve-{i}.pid").read_text()) for i in range(2)]
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=60) is not None
        for pid in pids:  # the replicas are gone too, not orphaned
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait(timeout=10)
