"""The quantized-weight CPU matmuls (csrc/cpu_quant_gemm.cpp) as Python functions: packing, the ops.

torch.ops.kvserve_quant.int4_gemm(x [M, K], packed) -> [M, N] in x's dtype: 4-bit weights in
groups of 32 along K with an fp16 scale and minimum each (llama.cpp's Q4_1);
torch.ops.kvserve_quant.int8_gemm: int8 weights with one scale per output channel (Int8Linear's).
Both quantize the activations per call to int8 in groups of 32 (llama.cpp's Q8_1) and multiply by
AVX-512 VNNI. They are torch library ops with Meta implementations, so a compiled forward keeps
each call as one graph node.

It needs AVX-512 (F, BW) with VNNI, checked against /proc/cpuinfo before anything is built, and a
C++ compiler (built once per machine, as the attention kernel is: kernels/cpu_kernel_build.py).
Where either is missing, `quant_gemm_available()` says so in one log line and callers use torch's
`_weight_int4pack_mm_for_cpu` instead.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvserve.kernels.cpu_kernel_build import load_optional_kernel

SOURCE = Path(__file__).with_name("csrc") / "cpu_quant_gemm.cpp"
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})
TILE = 16  # output channels per tile (the kernel's vector lanes)
GROUP = 32  # inputs per quantization group
TILE_BYTES = 4 * 64 + 2 * 2 * TILE  # nibbles, then fp16 scales and minima


INT8_GROUP_BYTES = TILE * GROUP


def int4_gemm_compatible(out_features: int, in_features: int, group_size: int) -> bool:
    return group_size == GROUP and out_features % TILE == 0 and in_features % GROUP == 0


def int8_gemm_compatible(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % GROUP == 0


def pack_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """q int [N, K] in 0..15, scale and minimum [N, K/32] (w = q * scale + minimum per group) ->
    uint8 [N/16, K/32, 320], the kernel's layout (described in csrc/cpu_quant_gemm.cpp)."""
    n, k = q.shape
    if not int4_gemm_compatible(n, k, GROUP) or scale.shape != (n, k // GROUP) or minimum.shape != scale.shape:
        raise ValueError(f"int4 packing needs N % {TILE} == 0, K % {GROUP} == 0 and [N, K/{GROUP}] scales, got "
                         f"q {tuple(q.shape)}, scales {tuple(scale.shape)}, minima {tuple(minimum.shape)}")
    tiles, groups = n // TILE, k // GROUP
    # k = 32 g + 8 v + 4 h + b for channel r: byte (v, r, b) holds h = 0 low and h = 1 high.
    nibbles = q.to(torch.uint8).reshape(tiles, TILE, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(tiles, groups, 4 * 64)

    def per_tile(values: torch.Tensor) -> torch.Tensor:  # [N, G] -> fp16 bytes [T, G, 32]
        halves = values.to(torch.float16).reshape(tiles, TILE, groups).permute(0, 2, 1).contiguous()
        return halves.view(torch.uint8).reshape(tiles, groups, 2 * TILE)

    return torch.cat([nibbles, per_tile(scale), per_tile(minimum)], dim=-1).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The float32 [N, K] weights a packed tensor holds (for tests and large-row fallbacks)."""
    tiles, groups, _ = packed.shape
    nibbles = packed[..., :256].reshape(tiles, groups, 4, TILE, 4)
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1)  # [T, G, v, r, b, h]
    q = q.permute(0, 3, 1, 2, 5, 4).reshape(tiles * TILE, groups * GROUP).float()

    def per_channel(start: int) -> torch.Tensor:  # fp16 bytes [T, G, 32] -> [N, G]
        halves = packed[..., start:start + 2 * TILE].contiguous().view(torch.float16)
        return halves.permute(0, 2, 1).reshape(tiles * TILE, groups).float()

    scale, minimum = per_channel(256), per_channel(256 + 2 * TILE)
    return (q.reshape(-1, groups, GROUP) * scale[..., None] + minimum[..., None]).reshape(tiles * TILE, -1)


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K], scale [N] (w = q * scale) -> uint8 [N/16, K/32 * 512 + 64], the kernel's
    layout (csrc/cpu_quant_gemm.cpp): q + 128 in tiles of 16 channels, then their fp32 scales."""
    n, k = q.shape
    if not int8_gemm_compatible(n, k) or scale.shape != (n,):
        raise ValueError(f"int8 packing needs N % {TILE} == 0, K % {GROUP} == 0 and [N] scales, got "
                         f"q {tuple(q.shape)}, scales {tuple(scale.shape)}")
    tiles, groups = n // TILE, k // GROUP
    unsigned = (q.to(torch.int16) + 128).to(torch.uint8).reshape(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)
    scales = scale.float().reshape(tiles, TILE).contiguous().view(torch.uint8)
    return torch.cat([unsigned.reshape(tiles, groups * INT8_GROUP_BYTES), scales], dim=-1).contiguous()


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The int8 [N, K] weights of a packed tensor, without their scales (for tests and many-row
    matmuls; integer ops only, which inductor fuses into one pass)."""
    tiles, width = packed.shape
    groups = (width - 4 * TILE) // INT8_GROUP_BYTES
    unsigned = packed[:, :groups * INT8_GROUP_BYTES].reshape(tiles, groups, 8, TILE, 4).permute(0, 3, 1, 2, 4)
    return (unsigned.to(torch.int16) - 128).to(torch.int8).reshape(tiles * TILE, groups * GROUP)


def load_quant_gemm(cache_dir: Path | None = None, compiler: str | None = None,
                   flags: frozenset[str] | None = None) -> bool:
    """Builds (once per machine) and loads the kernel; False, said in one log line, where this CPU
    lacks the instructions or the build fails."""
    return load_optional_kernel(SOURCE, REQUIRED_CPU_FLAGS, "VNNI int4/int8 kernels", "quantized layers use torch's ops",
                                cache_dir, compiler, flags)


@functools.cache  # one build-or-load attempt per process; a loaded library stays loaded anyway
def quant_gemm_available() -> bool:
    return load_quant_gemm()


def int4_gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32/bf16/fp16 times the packed int4 weights' transpose -> [M, N] in x's dtype.
    Only call after `quant_gemm_available()` returned True."""
    return torch.ops.kvserve_quant.int4_gemm(x, packed)


def int8_gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the packed int8 weights' transpose (pack_int8) -> [M, N] in x's dtype.
    Only call after `quant_gemm_available()` returned True (one library holds both)."""
    return torch.ops.kvserve_quant.int8_gemm(x, packed)
