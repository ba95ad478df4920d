"""Int4Linear: 4-bit weights in groups along K (asymmetric: a scale and an offset per group).

Two matmuls, chosen once per layer when it is built (`kernel`):
- "vnni" (the default where the CPU has AVX-512 VNNI and a compiler builds it): kvserve's own
  kernel (kernels/cpu_quant_gemm.py), llama.cpp's Q4_1 x Q8_1 scheme: activations quantized per
  call to int8 in groups of 32, integer dot products by `vpdpbusd`, fp16 scales. At one row it
  takes ~0.45x the time of torch's op on SmolLM2's layers with the weights in cache
  (benchmarks/quant_gemm.py), for the same bytes; from memory, as in a forward, both are
  bandwidth-bound on a busy 2-core Sapphire Rapids (~level); on a 2-core Zen 4 single-stream
  decode took 0.69x torch's time (benchmarks/int4_single_stream.py). The activations' int8 rounding is what
  llama.cpp pays too (KL from bf16 0.0070 against 0.0040: benchmarks/quant_accuracy.py).
- "torch": torch's `_weight_int4pack_mm_for_cpu` (any group size, any x86 CPU): at one row it
  reads a quarter of bf16's bytes and runs ~3x faster than bf16 `F.linear`, but it dequantizes to
  float and is compute-bound where VNNI's integer products are not.
Either runs every row count: at 64 rows both are slower than bf16 on AMX. int4 is the mode for
few concurrent streams; bf16 is the mode for batch throughput.

Groups of 32 along K match the default model's GGUF (Q4_1 stores 32-element blocks with a scale
and a minimum), so re-quantizing its dequantized weights recovers them nearly exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.cpu_quant_gemm import int4_gemm, quant_gemm_available, int4_gemm_compatible, pack_int4

GROUP_SIZE = 32
# The group sizes torch's CPU op accepts. Larger groups read fewer scales (groups of 64: ~10% fewer
# bytes per layer), but re-quantizing the default model's Q4_1 weights in groups of 64 loses their
# 32-element grid: passage NLL +11% and a mean KL of 0.36 nat/token from bf16, against +0.15% and
# 0.004 with groups of 32 (benchmarks/quant_accuracy.py).
GROUP_SIZES = (32, 64, 128, 256)
# torch's CPU packing interleaves 16 output channels; it refuses other multiples.
OUT_FEATURES_MULTIPLE = 16
KERNELS = ("auto", "vnni", "torch")  # auto: vnni where it runs (groups of 32, this CPU, a build), else torch


def int4_compatible(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> bool:
    return out_features % OUT_FEATURES_MULTIPLE == 0 and in_features % group_size == 0


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int32 [N, K] in 0..15, scale [N, K/g], zero [N, K/g]) in float32, with
    weight ~= (q - 8) * scale + zero per group: the convention of torch's int4 CPU op."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, low + 8.0 * scale


class Int4Linear(nn.Module):
    """`scales_and_zeros` None: `packed` is the VNNI kernel's layout (scales inside it)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor | None, group_size: int,
                 in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        groups = in_features // group_size
        if scales_and_zeros is not None and scales_and_zeros.shape != (groups, out_features, 2):
            raise ValueError(f"scales_and_zeros must be [K/g, N, 2] = [{groups}, {out_features}, 2], "
                             f"got {tuple(scales_and_zeros.shape)}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.vnni = scales_and_zeros is None
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # in the activation dtype: the op requires it
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE, kernel: str = "auto") -> "Int4Linear":
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
        if kernel not in KERNELS:
            raise ValueError(f"int4 kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        n, k = linear.out_features, linear.in_features
        if not int4_compatible(n, k, group_size):
            raise ValueError(f"int4 needs out_features % {OUT_FEATURES_MULTIPLE} == 0 and in_features % {group_size} "
                             f"== 0, got {n} x {k}")
        vnni_fits = int4_gemm_compatible(n, k, group_size) and linear.weight.device.type == "cpu"
        if kernel == "vnni" and not (vnni_fits and quant_gemm_available()):
            raise ValueError(f"the int4 VNNI kernel cannot run a {n} x {k} layer in groups of {group_size} on "
                             f"{linear.weight.device} here (groups of 32 on a CPU with AVX-512 VNNI and a C++ compiler)")
        dtype = linear.weight.dtype
        q, scale, zero = quantize_int4(linear.weight, group_size)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if kernel == "vnni" or (kernel == "auto" and vnni_fits and quant_gemm_available()):
            return cls(pack_int4(q, scale, zero - 8.0 * scale), None, group_size, k, n, bias)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(linear.weight.device), 2)
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(dtype)
        return cls(packed, scales_and_zeros, group_size, k, n, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.vnni:
            out = int4_gemm(rows, self.packed)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, kernel={'vnni' if self.vnni else 'torch'}")
