"""The C++ CPU kernels (csrc/cpu_paged_attention.cpp) as Python functions: paged attention, KV write.

It reads K/V straight from the cache blocks through the block tables: no per-layer copy of any
request's context, one pass over each (request, KV head)'s blocks with an online softmax in fp32.
bf16 caches use AMX tile multiplications where the CPU has them (Sapphire Rapids and later) and
Linux grants the tile state; without AMX, decodes of a bf16 model on a bf16, fp8 or int8 cache take
vdpbf16ps where AVX-512 BF16 is built (AMD Zen 4 and later), in segments of 256 keys with one
softmax step each; elsewhere the AVX-512 (or portable) loop serves.
Prompt chunks of bf16 models on a bf16 or fp8 cache take a route of their own wherever AVX-512
BF16 is built: tile matrix products on K/V packed once per work item (fp8 rows widened to bf16 as
they are packed), in AMX tiles or, without them, in vdpbf16ps.
Elsewhere (AVX-512 without BF16, AVX2; fp32/fp16 models), fresh prompts of 64+ tokens are the
exception: their K/V are gathered once and handed to torch's SDPA, whose flash kernel does their
quadratic work as matrix products.
Where it cannot be built (no compiler, a compile error) the torch path serves instead; that is
said once, in one log line.
"""

from __future__ import annotations

import functools
import logging
import subprocess
from pathlib import Path

import torch

from kvserve.kernels.cpu_kernel_build import KernelBuildError, load_library

logger = logging.getLogger(__name__)


LANES = 16  # the kernel works on 16-float vectors: head_dim must be a multiple, up to 16 of them
MAX_HEAD_DIM = 256


def cpu_kernel_supports(key_dim: int, value_dim: int) -> bool:
    """Keys and values of one width (a latent cache's differ: the torch path serves it)."""
    return key_dim == value_dim and key_dim % LANES == 0 and key_dim <= MAX_HEAD_DIM


def load_cpu_kernel(cache_dir: Path | None = None, compiler: str | None = None) -> bool:
    """Builds (once per machine, cached on disk) and loads the kernel; False, said in one log
    line, where that fails. A fresh compile logs its cost (the kernel's first-use cost)."""
    try:
        result = load_library(cache_dir, compiler)
    except (KernelBuildError, OSError, subprocess.SubprocessError) as error:
        logger.warning("CPU attention kernel unavailable, using the torch path: %s", error)
        return False
    if result.compiled:
        logger.info("compiled the CPU attention kernel in %.1f s (cached in %s)", result.seconds, result.library.parent)
    elif result.variant != "native":
        logger.info("CPU attention kernel: the prebuilt %s build (%s)", result.variant, result.library.name)
    return True


@functools.cache  # one build-or-load attempt per process; a loaded library stays loaded anyway
def cpu_kernel_available() -> bool:
    return load_cpu_kernel()


def cpu_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    score_scale: float,
    out_scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The contract of torch_attention.paged_attention with the scales already folded:
    `score_scale` = scale * k_scale multiplies every score, `out_scale` = v_scale every output;
    `sliding_window` w > 0: position p sees keys p - w + 1 .. p only; `soft_cap` c > 0: each
    scaled score s becomes c * tanh(s / c); an int8 cache's per-row scales in `key_scales` /
    `value_scales`. Only call after `cpu_kernel_available()` returned True."""
    return torch.ops.kvserve_cpu.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, score_scale, out_scale,
                                                 sliding_window, soft_cap, key_scales, value_scales)


def cpu_write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """The contract of torch_attention.write_kv_cache (scales already checked). Only call after
    `cpu_kernel_available()` returned True."""
    torch.ops.kvserve_cpu.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, key_scales,
                                         value_scales)
