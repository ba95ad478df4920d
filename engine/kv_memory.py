"""The default KV-cache size, when neither --num-kv-blocks nor --kv-cache-memory is given.

    CUDA                         90% of the device memory still free after the weights
    CPU, memory-limited cgroup   limit - weights - runtime overhead, at most 4 GiB
    CPU, no limit                a quarter of MemAvailable, at most 4 GiB (vLLM's CPU default)

On CPU, tensor-parallel ranks share the machine's RAM: they ask for one budget with every
rank's weights and one runtime overhead per process, and split it (engine/worker/kv_cache_sizing.py).

A container (`docker run --memory 2g`, a Kubernetes limit) sees the *host's* /proc/meminfo, so
sizing from it there gets the process OOM-killed; and MemAvailable moves from run to run. Under
a cgroup limit the budget is therefore computed from fixed quantities only (the limit, the
weights' bytes, a constant overhead), so a given limit always yields the same cache.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.engine.config import ConfigError

logger = logging.getLogger(__name__)

CPU_KV_CACHE_MAX_BYTES = 4 << 30
CPU_KV_CACHE_FRACTION = 0.25
CUDA_KV_CACHE_FRACTION = 0.9
# What the process needs beyond the weights and the KV cache, measured with SmolLM2-135M in bf16
# on CPU: ~0.5 GiB at rest (Python, torch, tokenizer, the HTTP server, loader leftovers) and
# ~0.85 GiB at the peak of a 2048-token prefill chunk (attention scores and MLP activations).
# Starting the compiled forward (torch.compile's modules, graphs loaded from inductor's cache)
# peaks ~0.65 GiB higher: under `docker run --memory 2g` a 1 GiB reserve was OOM-killed at
# start-up (cgroup peak 1.65 GB eager with a 0.75 GiB cache, 1.79 GB compiled with 0.25 GiB).
# Rounded up for margin. A larger --max-num-batched-tokens needs more: set --kv-cache-memory then.
CPU_RUNTIME_OVERHEAD_BYTES = 3 << 29  # 1.5 GiB
# cgroup v1 reports "no limit" as a huge page-aligned number (2^63 - 4096 on x86-64).
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemorySources:
    """Where memory facts are read from; tests point these at fake files."""

    cgroup_root: Path = Path("/sys/fs/cgroup")
    proc_self_cgroup: Path = Path("/proc/self/cgroup")
    meminfo: Path = Path("/proc/meminfo")


def default_kv_cache_bytes(device: torch.device, weights_bytes: int, min_kv_bytes: int,
                           sources: MemorySources = MemorySources(), *, num_processes: int = 1) -> int:
    """The KV budget in bytes. Raises ConfigError (naming --kv-cache-memory) when a memory limit
    leaves less than `min_kv_bytes` (one request of max_model_len) after weights and overhead.
    num_processes: the processes sharing this (CPU) memory, each with its runtime overhead."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * CUDA_KV_CACHE_FRACTION)
        logger.info("KV cache: %.2f GiB = %.0f%% of the %.2f GiB free on %s", budget / 2**30,
                    100 * CUDA_KV_CACHE_FRACTION, free / 2**30, device)
        return budget
    limit = cgroup_memory_limit(sources)
    total = _meminfo_bytes(sources.meminfo, "MemTotal:")
    if limit is None or (total is not None and limit >= total):
        available = _meminfo_bytes(sources.meminfo, "MemAvailable:")
        if available is None:  # no /proc (not Linux): what the OS reports as free pages
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        budget = int(min(CPU_KV_CACHE_MAX_BYTES, available * CPU_KV_CACHE_FRACTION))
        logger.info("KV cache: %.2f GiB = %.0f%% of the %.2f GiB available (no cgroup memory limit), at most %.0f GiB",
                    budget / 2**30, 100 * CPU_KV_CACHE_FRACTION, available / 2**30, CPU_KV_CACHE_MAX_BYTES / 2**30)
        return budget
    overhead = CPU_RUNTIME_OVERHEAD_BYTES * num_processes
    left = limit - weights_bytes - overhead
    if left < min_kv_bytes:
        raise ConfigError("--kv-cache-memory", (
            f"the memory limit of {limit / 2**30:.2f} GiB (cgroup) leaves {max(left, 0) / 2**20:.0f} MiB for the "
            f"KV cache after the weights ({weights_bytes / 2**20:.0f} MiB) and the runtime overhead "
            f"({overhead / 2**20:.0f} MiB), but one request of max_model_len needs "
            f"{min_kv_bytes / 2**20:.0f} MiB. Raise the memory limit, lower --max-model-len, or set "
            "--kv-cache-memory (or --num-kv-blocks) explicitly."))
    budget = min(CPU_KV_CACHE_MAX_BYTES, left)
    logger.info("KV cache: %.2f GiB = cgroup memory limit %.2f GiB - weights %.2f GiB - runtime overhead %.2f GiB"
                "%s; set --kv-cache-memory to choose another size", budget / 2**30, limit / 2**30,
                weights_bytes / 2**30, overhead / 2**30,
                f", capped at {CPU_KV_CACHE_MAX_BYTES / 2**30:.0f} GiB" if budget < left else "")
    return budget


def cpu_memory_headroom(weights_bytes: int, sources: MemorySources = MemorySources()) -> int | None:
    """Bytes this process may still take on CPU once its weights are loaded: under a cgroup limit,
    the limit less the weights and the runtime overhead (fixed quantities, as for the KV budget);
    else MemAvailable now. None where neither is known."""
    limit = cgroup_memory_limit(sources)
    total = _meminfo_bytes(sources.meminfo, "MemTotal:")
    if limit is not None and (total is None or limit < total):
        return max(limit - weights_bytes - CPU_RUNTIME_OVERHEAD_BYTES, 0)
    return _meminfo_bytes(sources.meminfo, "MemAvailable:")


def cgroup_memory_limit(sources: MemorySources = MemorySources()) -> int | None:
    """The tightest memory limit over this process's cgroup and its ancestors (v2 memory.max,
    else v1 memory.limit_in_bytes), or None when there is none."""
    v2, v1 = _cgroup_paths(sources.proc_self_cgroup)
    limits = []
    if v2 is not None:
        limits += [_read_limit(d / "memory.max") for d in _with_ancestors(sources.cgroup_root, v2)]
    if not any(limit is not None for limit in limits):
        v1_root = sources.cgroup_root / "memory"
        limits += [_read_limit(d / "memory.limit_in_bytes") for d in _with_ancestors(v1_root, v1 or "/")]
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _cgroup_paths(proc_self_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path ("0::/x") and v1 memory-controller path ("N:memory:/x")."""
    v2 = v1 = None
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return "/", None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _with_ancestors(root: Path, cgroup_path: str) -> list[Path]:
    """root/a/b, root/a, root. Inside a container's cgroup namespace the path is "/" and root
    is the container's own cgroup; a path that is not mounted here simply has no files."""
    parts = [part for part in cgroup_path.split("/") if part]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max" (v2): no limit
        return None
    value = int(text)
    return None if value >= _V1_UNLIMITED else value


def _meminfo_bytes(meminfo: Path, key: str) -> int | None:
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
