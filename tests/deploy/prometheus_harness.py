"""A real Prometheus server for tests: loopback only, temporary storage, bounded waits, killed at exit.

`running_prometheus(tmp_path, target)` starts Debian's `prometheus` with deploy/prometheus.yml's
settings, pointed at `target` ("host:port" of anything serving /metrics: the tiny exporter below,
or a live kvserve). `wait_for_value` then polls a PromQL query over the HTTP API until it returns
the expected number or the deadline passes.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml

from tests.deploy.kvserve_process import REPO
from tests.process_harness import background_process, free_port

PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus.yml"
PROMETHEUS_MISSING = "the prometheus server is absent: apt-get install prometheus (Debian's package)"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@dataclass
class Prometheus:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def query(self, promql: str) -> list[dict]:
        response = httpx.get(f"{self.base_url}/api/v1/query", params={"query": promql}, timeout=5.0)
        response.raise_for_status()
        body = response.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for_value(self, promql: str, expected: float, timeout_s: float = 60.0) -> float:
        """Poll until the query's single result equals `expected`; fail with what was seen."""
        deadline = time.monotonic() + timeout_s
        seen: list[dict] = []
        while time.monotonic() < deadline:
            seen = self.query(promql)
            if len(seen) == 1 and float(seen[0]["value"][1]) == expected:
                return expected
            time.sleep(0.5)
        targets = httpx.get(f"{self.base_url}/api/v1/targets", timeout=5.0).json()
        raise AssertionError(
            f"{promql} did not reach {expected} within {timeout_s} s; last result {seen}; targets {targets}; "
            f"log:\n{self.log_path.read_text(errors='replace')[-2000:]}"
        )


def scrape_config_for(target: str, scrape_interval: str = "1s") -> dict:
    """deploy/prometheus.yml with its kvserve job aimed at `target` and a test-speed interval."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = scrape_interval
    config["global"]["evaluation_interval"] = scrape_interval
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "kvserve"]
    job["static_configs"] = [{"targets": [target]}]
    return config


@contextmanager
def running_prometheus(tmp_path: Path, target: str, startup_timeout_s: float = 60.0) -> Iterator[Prometheus]:
    binary = prometheus_binary()
    if binary is None:
        raise RuntimeError(PROMETHEUS_MISSING)
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(scrape_config_for(target)))
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    base_url = f"http://127.0.0.1:{port}"
    with background_process(argv, log_path, f"{base_url}/-/ready", startup_timeout_s=startup_timeout_s,
                            stop_timeout_s=15) as running:
        yield Prometheus(base_url, running.process, log_path)


@contextmanager
def serving_metrics(render: Callable[[], tuple[bytes, str]]) -> Iterator[str]:
    """A tiny HTTP server on loopback answering GET /metrics with `render()`; yields host:port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body, content_type = render()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # keep scrapes out of the test output

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
