"""Facts about the machine and software a benchmark ran on, for the report's header.

Read from /proc and package metadata only: nothing here imports torch or loads a model, so the
facts cost nothing and cannot perturb the measurements.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("kvserve", "torch", "transformers", "triton", "numpy", "httpx")


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


def memory_gib(meminfo: str) -> float | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 1024**2, 1)  # the kernel's kB are KiB
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_revision() -> str:
    """HEAD's short hash, with "+changes" when the tracked benchmark inputs differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return f"{head}+changes" if dirty else head


def llama_server_version(binary: Path) -> str:
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "version" in line.lower()]
    return lines[0].strip() if lines else "unknown"


def machine_facts(llama_server: Path | None = None) -> dict[str, Any]:
    load = os.getloadavg()
    facts: dict[str, Any] = {
        "cpu": cpu_model(_read("/proc/cpuinfo")),
        "cores": os.cpu_count(),
        "memory_gib": memory_gib(_read("/proc/meminfo")),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in load],
        "git_revision": git_revision(),
        "versions": package_versions(),
    }
    if llama_server is not None:
        facts["versions"]["llama-server"] = llama_server_version(llama_server)
    return facts
