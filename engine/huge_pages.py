"""The KV cache's CPU memory on transparent huge pages, where Linux offers them on request.

A decode step reads each request's blocks wherever they lie in a cache of gigabytes: with 4 KB
pages nearly every 2 KB block of K or V is its own TLB miss (and, in a virtual machine, a nested
page walk). Linux's default THP mode on many distributions is `madvise`: a mapping gets 2 MB
pages only when asked. So each of the cache's planes is its own anonymous mapping, advised
(MADV_HUGEPAGE) before its pages are first touched, so that they are faulted in huge. Measured
on a 2-core AMD EPYC VM (SmolLM2's layer, 64 decodes of 128 / 512 tokens over 30 / 20 layers'
caches as benchmarks/attention_kernels.py builds them, the same caches copied onto huge pages or not,
interleaved in one process): attention 1.10x; W64 offline with the bf16 decode route of the
attention kernel, 1.08x at the median of 3 alternating pairs (benchmarks/offline.py). Best effort: where the call is missing or
refused (another OS, THP `never`, no free 2 MB pages), the memory is the same, on 4 KB pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    function = libc.madvise
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; a CPU tensor of at least one huge page gets its own anonymous mapping, advised
    onto huge pages (2 MB-aligned) before its pages are first touched. The allocator's memory may
    be pages already faulted in small (freed weights, an earlier tensor), which the advice would
    not change, so it is not used for these."""
    device = torch.device(device)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    madvise = _madvise()
    if device.type != "cpu" or madvise is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.zeros(shape, dtype=dtype, device=device)
    anchor = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(anchor)
    del anchor  # an exported buffer would keep the mapping from ever closing
    offset = -address % HUGE_PAGE
    madvise(address + offset, (len(region) - offset) // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    # The tensor holds the mapping; the OS's pages are zeros already, and writing them now faults
    # the memory in at start-up, as torch.zeros would (not later, under a full cache).
    tensor = torch.frombuffer(region, dtype=dtype, count=count, offset=offset).view(shape)
    return tensor.zero_()
