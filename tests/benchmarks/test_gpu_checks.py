"""benchmarks/gpu_checks.sh is run on a lent GPU machine, once: it must parse, and where no CUDA
device is there it must stop at once and say so, not write CPU figures under GPU names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_checks.sh"


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script would measure it")
def test_without_cuda_it_stops_with_exit_code_2_and_says_why(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("DEVICE", None)
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device" in done.stderr and "DEVICE=cpu QUICK=1" in done.stderr
    assert (tmp_path / "status.txt").read_text().strip() == "no CUDA device"
    assert not (tmp_path / "gpu_tests.log").exists()  # no step ran
