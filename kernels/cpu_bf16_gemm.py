"""kvserve's bf16 linear for decode steps (csrc/cpu_bf16_gemm.cpp) as Python functions: packing, the op.

torch.ops.kvserve_bf16.bf16_linear(x [..., K] bf16, packed, bias [N] or None, N) -> [..., N] bf16:
weights packed once (pack_bf16) into tiles of 16 output channels x pairs of inputs, multiplied with
fp32 sums (AVX-512 BF16 `vdpbf16ps` where the CPU has it, else each pair widened to fp32 in
registers for two FMAs), streaming the weights at memory bandwidth where oneDNN's prepacked matmul
does not (1-16 rows), with AMX tiles above that (faster than oneDNN up to ~128 rows;
benchmarks/bf16_gemm.py). On AVX-512 CPUs without BF16, where oneDNN emulates bf16, it is the
faster at every row count. A torch library op with a Meta implementation, so a compiled forward
keeps each call as one graph node.

torch.ops.kvserve_bf16.bf16_row_argmax(logits [rows, vocab] bf16) -> [rows] int64: greedy sampling's
argmax of the lm_head's bf16 logits, read once at memory speed (torch widens bf16 element by
element: 64 x 49152 logits, 2 threads, 173 us against 687 us for the sampler's chunked amax).

torch.ops.kvserve_bf16.bf16_linear_argmax(x [..., K] bf16, packed, N) -> [rows] int64: greedy
sampling straight from the lm_head: each row's argmax of the bf16 logits bf16_linear would return
(same rounding, argmax's rules), without writing them (at 64 rows x 49,152 the logits are 6 MB,
written and read back on top of the 56 MB of weights the lm_head streams).

torch.ops.kvserve_bf16.silu_mul(gate_up [..., 2I] bf16) -> [..., I] bf16: the gated MLP's
silu(gate) * up, bit for bit what the compiled forward's own kernel makes, with the fp32 silu of
each of bf16's 65,536 gate values looked up instead of computed (SmolLM2's 1,536-wide MLP, 2
threads, input in cache: 2.1 / 16 / 438 us against 18 / 47 / 931 us at 1 / 64 / 1,889 rows; in a
1,889-token prefill step, whose input comes from memory, 0.94 ms a layer).

torch.ops.kvserve_bf16.bf16_linear_silu_mul(x [..., K] bf16, packed gate_up, I) -> [..., I] bf16:
silu_mul(bf16_linear(x, packed, None, 2 I)) bit for bit, for a gated MLP's [gate | up] weights with I a
multiple of 16: the vector passes read each gate tile beside its up tile and write silu(gate) * up
from their sums, so the [rows, 2 I] output is neither written nor read back.

torch.ops.kvserve_bf16.decoder_layers(x, cos, sin, per-layer weights and caches, the step's metadata,
...) -> [rows, hidden] bf16: a stack of plain Llama blocks for one small step in one call, with no
Python between a layer's ops (engine/model/fused_decode.py decides where it applies).

It needs AVX-512 (F, BW), checked against /proc/cpuinfo before anything is built, and a C++
compiler (built once per machine like the other CPU kernels: kernels/cpu_kernel_build.py). Where
either is missing, `bf16_gemm_available()` says so in one log line and the layers keep oneDNN at
every row count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.cpu_kernel_build import cpu_flags, load_optional_kernel

SOURCE = Path(__file__).with_name("csrc") / "cpu_bf16_gemm.cpp"
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw"})
# x86 CPUs that multiply bfloat16 in hardware (AVX-512 BF16's vdpbf16ps, AMX's tiles). Without them
# oneDNN widens every bf16 operand in software (on a 2-core AVX-512 Xeon without BF16, its prepacked
# bf16 matmul ran the model's layers 1.7-4.5x slower than this kernel at 1-256 rows).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
TILE = 16  # output channels per tile (the kernel's vector lanes)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> bf16 [ceil(N/16), ceil(K/2), 16, 2], the kernel's layout (zero-padded):
    element (c, 2p + j) of tile t at [t, p, c, j]."""
    if weight.dim() != 2:
        raise ValueError(f"bf16 packing needs a [N, K] weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    padded = F.pad(weight.detach().to(torch.bfloat16), (0, k % 2, 0, -n % TILE))
    tiles, pairs = padded.shape[0] // TILE, padded.shape[1] // 2
    return padded.reshape(tiles, TILE, pairs, 2).permute(0, 2, 1, 3).contiguous()


def unpack_bf16(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [N, K] weights a packed tensor holds (for tests)."""
    tiles, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(tiles * TILE, pairs * 2)[:out_features, :in_features]


def native_bf16_arithmetic(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (`flags` of /proc/cpuinfo stand for its in tests) multiplies bf16 in hardware."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


def bf16_matrix_tiles(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU multiplies bf16 in matrix tiles (AMX), several times its vector rate."""
    return "amx_bf16" in (cpu_flags() if flags is None else flags)


def load_bf16_gemm(cache_dir: Path | None = None, compiler: str | None = None,
                   flags: frozenset[str] | None = None) -> bool:
    """Builds (once per machine) and loads the kernel; False, said in one log line, where this CPU
    lacks the instructions or the build fails."""
    return load_optional_kernel(SOURCE, REQUIRED_CPU_FLAGS, "bf16 few-row kernel",
                                "bf16 layers use oneDNN at every row count", cache_dir, compiler, flags)


@functools.cache  # one build-or-load attempt per process; a loaded library stays loaded anyway
def bf16_gemm_available() -> bool:
    return load_bf16_gemm()


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 times the packed weights' transpose, plus bias -> [..., out_features] bf16.
    Only call after `bf16_gemm_available()` returned True."""
    return torch.ops.kvserve_bf16.bf16_linear(x, packed, bias, out_features)


def bf16_row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of contiguous [rows, vocab] bf16 CPU logits, by argmax's rules (the first
    maximum; a NaN counts as the maximum). Only call after `bf16_gemm_available()` returned True."""
    return torch.ops.kvserve_bf16.bf16_row_argmax(logits)


def bf16_linear_argmax(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """bf16_row_argmax(bf16_linear(x, packed, None, out_features)) over x's rows, without the
    logits where AMX computes them (above 4 rows). Only call after `bf16_gemm_available()` returned True."""
    return torch.ops.kvserve_bf16.bf16_linear_argmax(x, packed, out_features)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of bf16 CPU rows [gate | up] ([..., 2I] -> [..., I]), computed as torch's
    compiled forward computes it (gate widened to fp32, gate / (exp(-gate) + 1), times up, rounded
    to bf16 once). Only call after `bf16_gemm_available()` returned True."""
    return torch.ops.kvserve_bf16.silu_mul(gate_up)


def bf16_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu_mul(bf16_linear(x, packed, None, 2 * intermediate)), the same bits, without the gate_up
    output: `packed` holds a gated MLP's [gate | up] weights, `intermediate` (a multiple of 16) rows
    of each. Only call after `bf16_gemm_available()` returned True."""
    return torch.ops.kvserve_bf16.bf16_linear_silu_mul(x, packed, intermediate)


def decoder_layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_norms: Sequence[torch.Tensor],
                   qkv_weights: Sequence[torch.Tensor], o_weights: Sequence[torch.Tensor],
                   post_norms: Sequence[torch.Tensor], gate_up_weights: Sequence[torch.Tensor],
                   down_weights: Sequence[torch.Tensor], key_caches: Sequence[torch.Tensor],
                   value_caches: Sequence[torch.Tensor], meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
                   intermediate_size: int, eps: float, scale: float) -> torch.Tensor:
    """A stack of plain Llama blocks over x [rows, hidden] bf16 for one step (cos, sin [rows,
    head_dim]; one packed weight per layer and linear, one bf16 cache pair per layer; `meta` the
    step's, full attention): the last block's output, as the compiled layers compute it, bit for bit.
    This step's K/V go into the caches. Only call after `bf16_gemm_available()` and the C++
    attention kernel (kernels/cpu_attention.py) both returned True."""
    return torch.ops.kvserve_bf16.decoder_layers(
        x, cos, sin, list(input_norms), list(qkv_weights), list(o_weights), list(post_norms), list(gate_up_weights),
        list(down_weights), list(key_caches), list(value_caches), meta.slot_mapping, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, num_heads, num_kv_heads, intermediate_size, eps, scale)
