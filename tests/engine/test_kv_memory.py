"""The default KV budget under fake cgroup and meminfo files: a container limit (v2 memory.max or
v1 memory.limit_in_bytes) decides it, deterministically; too small a limit refuses to start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvserve.engine.config import ConfigError
from kvserve.engine.kv_memory import (
    CPU_KV_CACHE_MAX_BYTES,
    CPU_RUNTIME_OVERHEAD_BYTES,
    MemorySources,
    cgroup_memory_limit,
    default_kv_cache_bytes,
)

GiB = 1 << 30
MiB = 1 << 20
CPU = torch.device("cpu")
WEIGHTS = 257 * MiB
ONE_REQUEST = 180 * MiB


def host(tmp_path: Path, *, total: int = 64 * GiB, available: int = 40 * GiB, proc_cgroup: str = "0::/\n",
         files: dict[str, str] | None = None) -> MemorySources:
    root = tmp_path / "cgroup"
    root.mkdir()
    for relative, text in (files or {}).items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    (tmp_path / "cgroup_of_self").write_text(proc_cgroup)
    (tmp_path / "meminfo").write_text(f"MemTotal: {total // 1024} kB\nMemFree: 1 kB\nMemAvailable: {available // 1024} kB\n")
    return MemorySources(root, tmp_path / "cgroup_of_self", tmp_path / "meminfo")


def test_v2_container_limit_sizes_the_cache(tmp_path: Path) -> None:
    sources = host(tmp_path, files={"memory.max": f"{2 * GiB}\n"})
    budget = default_kv_cache_bytes(CPU, WEIGHTS, ONE_REQUEST, sources)
    assert budget == 2 * GiB - WEIGHTS - CPU_RUNTIME_OVERHEAD_BYTES
    # Same limit, same answer, whatever the host's free memory does.
    (tmp_path / "meminfo").write_text(f"MemTotal: {64 * GiB // 1024} kB\nMemAvailable: {GiB // 1024} kB\n")
    assert default_kv_cache_bytes(CPU, WEIGHTS, ONE_REQUEST, sources) == budget


def test_v1_limit_in_bytes_is_read(tmp_path: Path) -> None:
    sources = host(tmp_path, proc_cgroup="12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n",
                   files={"memory/memory.limit_in_bytes": f"{3 * GiB}\n"})
    assert cgroup_memory_limit(sources) == 3 * GiB
    assert default_kv_cache_bytes(CPU, WEIGHTS, ONE_REQUEST, sources) == 3 * GiB - WEIGHTS - CPU_RUNTIME_OVERHEAD_BYTES


def test_the_tightest_limit_on_the_path_wins(tmp_path: Path) -> None:
    sources = host(tmp_path, proc_cgroup="0::/kubepods/pod1/ctr\n", files={
        "kubepods/memory.max": "max\n",
        "kubepods/pod1/memory.max": f"{5 * GiB}\n",
        "kubepods/pod1/ctr/memory.max": f"{6 * GiB}\n",
    })
    assert cgroup_memory_limit(sources) == 5 * GiB


@pytest.mark.parametrize("files", [
    {"memory.max": "max\n"},  # v2 without a limit
    {"memory/memory.limit_in_bytes": "9223372036854771712\n"},  # v1's "unlimited"
    {},  # no cgroup files at all
])
def test_no_limit_falls_back_to_a_share_of_available_memory(tmp_path: Path, files: dict[str, str]) -> None:
    sources = host(tmp_path, available=8 * GiB, files=files)
    assert cgroup_memory_limit(sources) is None
    assert default_kv_cache_bytes(CPU, WEIGHTS, ONE_REQUEST, sources) == 2 * GiB  # a quarter of 8 GiB


def test_a_limit_above_physical_memory_is_no_limit(tmp_path: Path) -> None:
    sources = host(tmp_path, total=16 * GiB, available=4 * GiB, files={"memory.max": f"{100 * GiB}\n"})
    assert default_kv_cache_bytes(CPU, WEIGHTS, ONE_REQUEST, sources) == GiB


def test_a_generous_limit_is_capped(tmp_path: Path) -> None:
    sources = host(tmp_path, files={"memory.max": f"{32 * GiB}\n"})
    assert default_kv_cache_bytes(CPU, WEIGHTS, ONE_REQUEST, sources) == CPU_KV_CACHE_MAX_BYTES


def test_a_limit_too_small_refuses_to_start_naming_the_flag(tmp_path: Path) -> None:
    sources = host(tmp_path, files={"memory.max": f"{1300 * MiB}\n"})
    with pytest.raises(ConfigError) as raised:
        default_kv_cache_bytes(CPU, WEIGHTS, ONE_REQUEST, sources)
    assert raised.value.option == "--kv-cache-memory"
    assert "--kv-cache-memory" in str(raised.value) and "1.27 GiB" in str(raised.value)


def test_the_decision_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sources = host(tmp_path, files={"memory.max": f"{2 * GiB}\n"})
    with caplog.at_level(logging.INFO, logger="kvserve.engine.kv_memory"):
        default_kv_cache_bytes(CPU, WEIGHTS, ONE_REQUEST, sources)
    assert "cgroup memory limit 2.00 GiB" in caplog.text and "--kv-cache-memory" in caplog.text
