"""--cpu-threads' default: OMP_NUM_THREADS if set, else the affinity mask capped by the cgroup quota."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine.cpu_threads import apply_cpu_threads, cgroup_cpu_limit, default_cpu_threads, read_cpu_max


@pytest.mark.parametrize("text,cpus", [
    ("max 100000", None), ("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1), ("100000 100000", 1),
    (None, None), ("", None), ("garbage", None), ("-1 100000", None), ("abc 100000", None),
])
def test_cgroup_cpu_max_is_read_as_cpus_rounded_up(text, cpus) -> None:
    assert cgroup_cpu_limit(text) == cpus


@pytest.mark.parametrize("affinity,cpu_max,omp,threads", [
    ({0, 1, 2, 3}, None, None, 4),  # no quota: every CPU we may run on
    (set(range(64)), "200000 100000", None, 2),  # a container limited to 2 CPUs on a 64-core host
    ({0, 1}, "400000 100000", None, 2),  # quota above the mask: the mask wins
    ({3}, "max 100000", None, 1),  # pinned to one core
    (set(range(8)), "200000 100000", "3", 3),  # OMP_NUM_THREADS pins it, as it does torch
    (set(range(8)), None, "0", 8),  # a meaningless OMP_NUM_THREADS is ignored
    (set(range(8)), None, "two", 8),
])
def test_default_threads(affinity, cpu_max, omp, threads) -> None:
    assert default_cpu_threads(affinity, cpu_max, omp) == threads


def test_reads_this_process_cgroup_v2_file_first(tmp_path: Path) -> None:
    (tmp_path / "kubepods" / "pod1").mkdir(parents=True)
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    assert read_cpu_max(tmp_path, proc) == "300000 100000"
    proc.write_text("0::/elsewhere\n")
    assert read_cpu_max(tmp_path, proc) == "max 100000"


def test_reads_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(read_cpu_max(tmp_path, tmp_path / "none")) == 3
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(read_cpu_max(tmp_path, tmp_path / "none")) is None


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert read_cpu_max(tmp_path, tmp_path / "none") is None


def test_apply_sets_torch_threads_once() -> None:
    before = torch.get_num_threads()
    try:
        assert apply_cpu_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
