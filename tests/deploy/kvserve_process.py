"""Start kvserve the way the container image does, on this machine, and wait for /health.

Shared by the Dockerfile command test and the live Prometheus scrape test. The command is read
from the Dockerfile (ENTRYPOINT + CMD) and the image's ENV is applied, except that the server
binds loopback instead of 0.0.0.0 and the port is a free one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.dockerfile import image_command, image_env
from tests.process_harness import background_process, free_port

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
VENV_BIN = Path(sys.executable).parent


def missing_serve_command() -> str | None:
    """Why the image command cannot run here yet, or None when it can."""
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.server.cli", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        return f"kvserve.server.cli has no working `serve` command yet: {(result.stderr or result.stdout).strip()[-300:]}"
    return None


@dataclass
class RunningServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def image_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(image_env(DOCKERFILE))
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # the image's /opt/venv/bin
    env["KVSERVE_HOST"] = "127.0.0.1"  # never listen on every interface of a shared test machine
    env.pop("KVSERVE_CACHE", None)  # the image's path is /home/kvserve/...; use this user's default
    return env


@contextmanager
def run_image_command(tmp_path: Path, extra_args: Sequence[str] = (), startup_timeout_s: float = 240.0) -> Iterator[RunningServer]:
    """Run ENTRYPOINT + CMD + `--port <free>` + extra_args; yield once /health answers 200."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = [*image_command(DOCKERFILE), "--port", str(port), *extra_args]
    with background_process(argv, tmp_path / "kvserve.log", f"{base_url}/health", env=image_environment(),
                            startup_timeout_s=startup_timeout_s) as running:
        yield RunningServer(base_url, running.process, running.log_path)
