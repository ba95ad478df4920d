"""The real image: built from the Dockerfile and run with Docker (marker `docker`, excluded from
default runs: `pytest -m docker tests/deploy/test_image.py`; skipped where no daemon answers).

Built on two bases, each test running against both: a slim Python (no compiler: the image adds
one) and a full one (compiler and headers already there), as users pick python:3.11-slim or
python:3.11. Checked as an operator would: Docker's own health status turns healthy, a completion
and /metrics work, the server is not root, it serves with the compiled forward and the prebuilt
CPU attention kernel, with no compiler it still serves (eagerly, saying so), `docker stop` drains
(an in-flight stream finishes) and exits 0 within the grace period, `--memory 2g` starts and
serves with no other settings, and a `--port` argument keeps the container healthy.

Containers use the host's network (`--network host`: machines without bridge networking run it
too) and listen on 127.0.0.1 only. Environment:
  KVSERVE_IMAGE             test this image instead of building any (e.g. kvserve:cpu)
  KVSERVE_IMAGE_BASES       the base images to build on, space-separated (default:
                            python:3.11-slim-bookworm python:3.11-bookworm); where no registry is
                            reachable, tests/deploy/local_base_images.sh makes local stand-ins:
                            "local/python:3.11-slim local/python:3.11-full"
  KVSERVE_IMAGE_BUILD_ARGS  extra `docker build` arguments, e.g. a local wheel folder:
                            --build-arg PIP_FIND_LINKS=http://127.0.0.1:8765/ ...
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

# Building an image (its first time on a base: ~20 min on a busy 2-core machine) happens in the
# first test's fixture, past the suite's 900 s default.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 60  # generous: a loaded CPU decodes slowly, and the stream must finish within it
HEALTHY_WITHIN_S = 300


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def daemon_unreachable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        result = docker("info", "--format", "{{.ServerVersion}}", timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return "the docker daemon did not answer within 20 s"
    if result.returncode != 0:
        return f"no docker daemon reachable: {result.stderr.strip()[:200]}"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DEFAULT_BASES = "python:3.11-slim-bookworm python:3.11-bookworm"


def bases() -> list[str]:
    if os.environ.get("KVSERVE_IMAGE"):
        return ["given"]
    return os.environ.get("KVSERVE_IMAGE_BASES", DEFAULT_BASES).split()


@pytest.fixture(scope="module", params=bases())
def image(request: pytest.FixtureRequest) -> Iterator[str]:
    reason = daemon_unreachable()
    if reason is not None:
        pytest.skip(reason)
    given = os.environ.get("KVSERVE_IMAGE")
    if given:
        yield given
        return
    tag = f"kvserve:test-{uuid.uuid4().hex[:8]}"
    extra = shlex.split(os.environ.get("KVSERVE_IMAGE_BUILD_ARGS", ""))
    build = docker("build", "--network", "host", "-t", tag, "--build-arg", f"PYTHON_IMAGE={request.param}", *extra,
                   str(REPO), timeout=2400, check=False)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    yield tag
    docker("rmi", "-f", tag, check=False)


class Container:
    def __init__(self, image: str, port: int, *, docker_args: tuple[str, ...] = (), args: tuple[str, ...] = ()):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.name = f"kvserve-test-{uuid.uuid4().hex[:8]}"
        docker("run", "-d", "--name", self.name, "--network", "host", "-e", "KVSERVE_HOST=127.0.0.1",
               "-e", f"KVSERVE_SHUTDOWN_GRACE_PERIOD={GRACE_S}", *docker_args, image, *args)

    def inspect(self) -> dict:
        return json.loads(docker("inspect", self.name).stdout)[0]

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + HEALTHY_WITHIN_S
        while time.monotonic() < deadline:
            state = self.inspect()["State"]
            assert state["Running"], f"container exited {state['ExitCode']}: {self.logs()}"
            if state["Health"]["Status"] == "healthy":
                return
            time.sleep(2)
        raise AssertionError(f"not healthy after {HEALTHY_WITHIN_S} s: {self.inspect()['State']['Health']}\n{self.logs()}")

    def logs(self) -> str:
        return self.logs_from_start()[-4000:]

    def logs_from_start(self) -> str:
        result = docker("logs", self.name, check=False)
        return result.stdout + result.stderr

    def remove(self) -> None:
        docker("rm", "-f", self.name, check=False)


def complete(url: str, max_tokens: int = 8) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def default_container(image: str) -> Iterator[Container]:
    port = free_port()
    container = Container(image, port, docker_args=("-e", f"KVSERVE_PORT={port}"))
    try:
        container.wait_healthy()
        yield container
    finally:
        container.remove()


def test_healthy_serves_completions_and_metrics_as_non_root(default_container: Container) -> None:
    body = complete(default_container.url)
    assert body["usage"]["completion_tokens"] == 8 and body["model"] == "SmolLM2-135M-Instruct"
    metrics = httpx.get(f"{default_container.url}/metrics", timeout=30).text
    assert "kvserve_num_requests_running" in metrics and 'state="free"' in metrics
    assert docker("exec", default_container.name, "id", "-u").stdout.strip() == "10001"


def test_serves_with_the_compiled_forward_and_the_prebuilt_cpu_kernel(default_container: Container) -> None:
    logs = default_container.logs_from_start()
    assert "compiled forward" in logs and "running the forward eagerly" not in logs, logs[-3000:]
    assert "CPU attention kernel: the prebuilt" in logs and "using the torch path" not in logs, logs[-3000:]


def test_structured_output_works_in_the_image(default_container: Container) -> None:
    # xgrammar imports part of transformers: whatever the image trims must leave that working.
    response = httpx.post(f"{default_container.url}/v1/completions", timeout=120, json={
        "prompt": "Answer yes or no: is water wet?", "max_tokens": 4, "temperature": 0,
        "structured_outputs": {"choice": ["yes", "no"]}})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in ("yes", "no")


def test_without_a_compiler_it_serves_eagerly_says_so_and_keeps_the_prebuilt_kernel(image: str) -> None:
    port = free_port()
    container = Container(image, port, docker_args=("-e", f"KVSERVE_PORT={port}", "-e", "CXX=/nonexistent/c++"))
    try:
        container.wait_healthy()
        assert complete(container.url)["usage"]["completion_tokens"] == 8
        logs = container.logs_from_start()
        assert "no C++ compiler (/nonexistent/c++) on PATH: running the forward eagerly" in logs, logs[-3000:]
        assert "CPU attention kernel: the prebuilt" in logs, logs[-3000:]
    finally:
        container.remove()


def test_docker_stop_drains_an_in_flight_stream_and_exits_0(default_container: Container) -> None:
    events: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{default_container.url}/v1/completions", timeout=120, json={
                "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(60), "the stream never started"
    started = time.monotonic()
    docker("stop", "-t", str(GRACE_S + 15), default_container.name, timeout=GRACE_S + 60)
    stopped_after = time.monotonic() - started
    reader.join(30)
    state = default_container.inspect()["State"]
    assert state["ExitCode"] == 0 and not state["OOMKilled"], default_container.logs()
    assert stopped_after < GRACE_S + 10
    assert events[-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
    assert finish[-1] == "length", "the in-flight stream was cut instead of finishing"


def test_memory_limited_container_with_a_port_argument_is_healthy_and_serves(image: str) -> None:
    port = free_port()
    # --port as an argument (the image sets KVSERVE_PORT=8000): the health check must follow it.
    container = Container(image, port, docker_args=("--memory", "2g"), args=("--port", str(port)))
    try:
        container.wait_healthy()
        assert complete(container.url, max_tokens=16)["usage"]["completion_tokens"] == 16
        state = container.inspect()["State"]
        assert state["Running"] and not state["OOMKilled"]
        assert "cgroup memory limit 2.00 GiB" in container.logs()
    finally:
        container.remove()
