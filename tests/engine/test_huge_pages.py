"""The KV cache's planes on transparent huge pages (engine/huge_pages.py)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from kvserve.engine import huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap `tensor`'s memory, from /proc/self/smaps."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    total, overlapping = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            overlapping = low < end and high > start
        elif overlapping and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_zeros_are_zeros_of_the_shape_and_dtype_asked_for():
    for shape, dtype in [((3, 5), torch.bfloat16), ((1024, 4096), torch.float16), ((0, 8), torch.float32)]:
        tensor = huge_pages.zeros(shape, dtype, torch.device("cpu"))
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
        assert not tensor.any()


def test_a_plane_outlives_every_other_reference_to_its_mapping():
    plane = huge_pages.zeros((1024, 2048), torch.float32, torch.device("cpu"))  # 8 MiB: its own mapping
    gc.collect()
    plane += 2.0
    assert plane.sum().item() == 2.0 * plane.numel() and plane.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_small_tensors_and_other_devices_get_torch_zeros():
    assert not huge_pages.zeros((1000,), torch.float32, torch.device("cpu")).any()
    assert huge_pages.zeros((8 << 20,), torch.float32, torch.device("meta")).device.type == "meta"


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP_MODE.exists()
                    or "[never]" in THP_MODE.read_text(), reason="needs Linux with transparent huge pages")
def test_a_large_cpu_cache_plane_is_faulted_in_on_huge_pages():
    # After other large tensors came and went (the allocator would hand their touched pages back).
    for _ in range(3):
        torch.ones(4096, 3072, dtype=torch.bfloat16).sum()
    plane = huge_pages.zeros((4096, 3072), torch.bfloat16, torch.device("cpu"))  # 24 MiB
    # The kernel may lack free 2 MB pages at this moment (fragmentation): at least some is huge.
    assert _anon_huge_kb(plane) >= 2048
