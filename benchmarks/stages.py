"""Run one benchmark stage as a subprocess with a hard time limit, echoing its output as progress.

Each stage is its own process so that a stage that hangs or crashes (say, transformers'
continuous-batching API on a CPU) is killed at its limit and reported, and the others still run.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STATUSES = ("ok", "failed", "timed out", "skipped")


@dataclass(frozen=True)
class StageResult:
    name: str
    status: str  # one of STATUSES
    command: str  # as a user would type it, from the repository root
    seconds: float
    note: str = ""  # why it was skipped, or the end of its log when it failed
    log: str = ""  # the log file, relative to the repository root

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"stage status must be one of {STATUSES}, got {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def display_command(argv: Sequence[str]) -> str:
    """The command as typed from the repository root: venv scripts by name, repo paths relative."""
    venv_bin = str(Path(sys.executable).parent) + os.sep
    shown = []
    for arg in argv:
        if arg == sys.executable:
            arg = "python"
        elif arg.startswith(venv_bin):
            arg = arg[len(venv_bin):]
        shown.append(arg.replace(str(REPO) + os.sep, ""))
    return shlex.join(shown)


def relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _tee(stream: Any, log: Any, prefix: str) -> None:
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        line = raw.decode(errors="replace").rstrip()
        if line:
            print(f"  [{prefix}] {line}", flush=True)


def run_stage(name: str, argv: Sequence[str], timeout_s: float, log_path: Path, cwd: Path = REPO,
              env: Mapping[str, str] | None = None) -> StageResult:
    """Run `argv`; kill its whole process group at `timeout_s`. Never raises for the stage's own failure."""
    command = display_command(argv)
    print(f"==> {name}: {command}  (limit {timeout_s:.0f} s)", flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log_path.open("wb") as log:
        process = subprocess.Popen(list(argv), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=dict(env) if env is not None else None)
        reader = threading.Thread(target=_tee, args=(process.stdout, log, name), daemon=True)
        reader.start()
        try:
            code = process.wait(timeout=timeout_s)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            code, status = None, "timed out"
        reader.join(timeout=10)
    seconds = time.perf_counter() - start
    note = ""
    if status != "ok":
        tail = log_path.read_text(errors="replace").strip().splitlines()[-6:]
        reason = f"exit code {code}" if status == "failed" else f"killed at the {timeout_s:.0f} s limit"
        note = f"{reason}; log ends: " + " / ".join(line.strip() for line in tail)
    print(f"<== {name}: {status} in {seconds:.0f} s", flush=True)
    return StageResult(name=name, status=status, command=command, seconds=seconds, note=note, log=relative(log_path))


def skipped(name: str, why: str, command: str = "") -> StageResult:
    print(f"--- {name}: skipped ({why})", flush=True)
    return StageResult(name=name, status="skipped", command=command, seconds=0.0, note=why)
