"""`kvserve serve --tensor-parallel-size N`: a size the model's heads do not divide is a usage
error (exit 2) before anything loads; a fitting one serves, and stops its workers on SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvserve.server.cli import main
from tests.process_harness import background_process, free_port
from tests.server.tiny_checkpoint import write_tiny_checkpoint


def test_a_size_that_does_not_divide_the_heads_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_checkpoint(tmp_path / "tiny", heads=4, kv_heads=2)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", str(model), "--tensor-parallel-size", "4"])
    assert exited.value.code == 2
    assert "--tensor-parallel-size 4 does not divide the model's 2 KV heads; sizes that fit this model: 1, 2" \
        in capsys.readouterr().err


@pytest.mark.slow
def test_serve_with_two_ranks_answers_and_stops_its_workers(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "tiny", heads=4, kv_heads=2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(Path(sys.executable).parent / "kvserve"), "serve", "--model", str(model), "--port", str(port),
            "--tensor-parallel-size", "2", "--dtype", "float32", "--num-kv-blocks", "64", "--served-model-name", "tiny",
            "--enforce-eager"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with background_process(argv, tmp_path / "kvserve.log", f"{url}/health", env=env) as server:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60, trust_env=False)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(f"{url}/server_info", timeout=10, trust_env=False).json()["tp_size"] == 2
        children = _children(server.process.pid)
        assert len(children) >= 1  # the rank-1 worker (plus multiprocessing's resource tracker)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker leaves once it sees EOF
    while (alive := [_cmdline(pid) for pid in children if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()]


def _running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except FileNotFoundError:
        return ""
