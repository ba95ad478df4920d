"""How many intra-op threads torch gets: `--cpu-threads N`, or what this process may really use.

The default is the smaller of the CPUs in this process's affinity mask and its cgroup CPU quota
(`cpu.max`, rounded up), so a container limited to 2 CPUs on a 64-core host runs 2 threads, not
64 that would spin against each other. An explicit OMP_NUM_THREADS wins over that default, as it
does for torch itself: it is how a benchmark or a test run pins every process alike.

Threads and the server: torch's OpenMP team is the engine thread (its master) plus N-1 workers.
The HTTP event loop does no torch work (it parses, tokenizes with the Rust tokenizer, serialises;
detokenization and sampling run on the engine thread), so it is mostly idle while a step runs.
We still give torch every allowed core by default, since one step's matmuls dominate; on a host
shared with other busy processes pass fewer (`--cpu-threads 1`): OpenMP workers that wait on a
descheduled peer slow a step many-fold.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(cpu_max: str | None) -> int | None:
    """cgroup v2 `cpu.max` text ("max 100000" or "QUOTA PERIOD") -> CPUs it allows, rounded up;
    None when there is no limit or the text is not understood."""
    if cpu_max is None:
        return None
    fields = cpu_max.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def default_cpu_threads(affinity: Collection[int], cpu_max: str | None, omp_num_threads: str | None) -> int:
    """The thread count when --cpu-threads is not given (pure: every input passed in)."""
    if omp_num_threads is not None and omp_num_threads.strip().isdigit() and int(omp_num_threads) > 0:
        return int(omp_num_threads)
    cpus = max(1, len(affinity))
    limit = cgroup_cpu_limit(cpu_max)
    return cpus if limit is None else min(cpus, limit)


def read_cpu_max(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> str | None:
    """This process's cgroup v2 cpu.max, as "QUOTA PERIOD" text; v1's cfs files in the same form."""
    candidates = [root / "cpu.max"]
    try:
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                candidates.insert(0, root / line[3:].lstrip("/") / "cpu.max")
    except OSError:
        pass
    for path in candidates:
        try:
            return path.read_text().strip()
        except OSError:
            continue
    try:  # cgroup v1
        quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return f"{'max' if quota.startswith('-') else quota} {period}"


def resolve_cpu_threads(requested: int | None) -> int:
    if requested is not None:
        return requested
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return default_cpu_threads(affinity, read_cpu_max(), os.environ.get("OMP_NUM_THREADS"))


def apply_cpu_threads(requested: int | None) -> int:
    """Sets torch's intra-op thread count once, at engine start; returns it."""
    threads = resolve_cpu_threads(requested)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
