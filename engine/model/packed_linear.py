"""Linear layers whose bf16 weights are reordered once, at load, into oneDNN's blocked layout.

A plain bf16 `F.linear` on CPU hands oneDNN a row-major weight, which it reorders into the
blocked (VNNI / AMX tile) layout its kernels read, on every call: a decode step re-copies all
~270 MB of weights before multiplying. Measured on the model's own shapes (30 layers x 4 matrices,
each a separate tensor as in a real forward), the prepacked matmul takes ~0.6-0.7x the time of
`F.linear` at 1 to 256 rows, with bit-identical results (benchmarks/compiled_forward.py --dense).
This is what inductor's "freezing + weight prepack" does for a whole-model compile; kvserve
compiles one layer's graph for all 30 layers (engine/compilation.py), so the weights are graph
inputs, not constants, and inductor cannot pack them itself. Packing them here instead works for
the compiled and the eager forward alike.

The packed tensor is opaque (layout torch._mkldnn): it is used only through the op below, which
torch.compile keeps as one node. float32 models keep plain nn.Linear (MKL's sgemm, as
transformers runs them: `--dtype float32` stays bit-faithful to it), except where `--dtype auto`
chose float32 for speed, on a CPU with neither bf16 arithmetic nor AVX-512 (engine/device.py): there oneDNN's
packed fp32 kernels are faster than MKL's on every shape of the model (2-core AVX2 Zen 2, weights
hot, 1-256 rows: the lm_head 2.2-2.5x at 1-64 rows, the layers' matmuls 1.2-2x at 8-64 rows,
level at 1 row), adding the same sums in another order (float32 rounding: ~1e-4 on those shapes'
outputs).

At few rows (a single stream, a handful of decodes) oneDNN's packed matmul reads the weights at
a third of the memory bandwidth, and up to ~128 rows (decode steps) kvserve's own kernel's AMX
blocking is faster too; there kvserve's bf16 kernel (kernels/cpu_bf16_gemm.py) runs from a
second copy of the weights in its own layout, and oneDNN keeps the larger row counts (prompt
chunks), but for narrow layers on CPUs with AMX (NARROW_OUT_FEATURES), where oneDNN blocks some
prompt-chunk row counts badly and the kernel keeps them up to NARROW_ROWS_MAX rows, and on CPUs with
AVX-512 BF16 but no AMX (AMD Zen 4, Cooper Lake), where the kernel's vector passes beat oneDNN's
matmul up to VECTOR_ROWS_MAX rows. The two round
the same fp32 sums to bf16 but may add them in another order: results agree to bf16's last bit,
not always bit for bit. The compiled graph branches on the row count, as the quantized layers'
graphs do.

On a CPU without bf16 arithmetic (AVX-512 without BF16: Skylake-SP to Ice Lake, or a hypervisor
hiding it) oneDNN emulates bf16, and kvserve's kernel (fp32 FMAs on widened pairs) was 1.7-4.5x
faster than its packed bf16 matmul at every row count, 1 to 256 (benchmarks/bf16_gemm.py). There a
bf16 layer keeps the kernel's copy alone: no oneDNN copy, no second copy of the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.cpu_bf16_gemm import (TILE, bf16_gemm_available, bf16_linear, bf16_linear_argmax,
                                           bf16_linear_silu_mul, bf16_matrix_tiles, native_bf16_arithmetic,
                                           pack_bf16)

PACKABLE_DTYPES = (torch.bfloat16,)
# Up to this many rows kvserve's bf16 kernel beats oneDNN's packed matmul (quiet machine,
# `benchmarks/bf16_gemm.py`: the model's shapes with the weights streaming from memory,
# interleaved: 1.4-1.8x at 1-16 rows, 1.2-1.3x at 64, 1.05-1.2x at 128 on the layers; past ~160
# rows, prompt chunks, oneDNN's blocking wins). The lm_head is 0.95x at 64 and 0.87x at 128.
FEW_ROWS_MAX = 128
# Layers of at most this many output channels keep kvserve's kernel up to NARROW_ROWS_MAX rows on
# CPUs with AMX tiles: there oneDNN's packed matmul blocks many row counts badly. SmolLM2's layers,
# weights streaming, both cores of a Sapphire Rapids (benchmarks/bf16_gemm.py --rows 160,...,1280),
# oneDNN's time over the kernel's: down (576 outputs) 1.1-1.9x at 160-1280 rows, o (576) 1.1-1.65x
# at 160-768 but 0.8x at 896-1024, qkv (960) 0.8-1.0x at 256-640 but 1.4-1.5x at 768-1024; the three
# together 1.1-1.6x at 256-1024 rows. Wider layers stay with oneDNN (gate_up, 3072 outputs:
# 0.72-0.8x at 256+ rows). Prompt chunks of 129-1024 tokens are what this speeds up. Only up to
# NARROW_IN_FEATURES inputs, where the kernel's 256-row chunk of activations (1 MB at 2048) stays in
# L2: measured the same way, 576x2048 1.2-2.0x at 160-1024 rows, but 1024x4096 0.8-0.9x at 256+.
NARROW_OUT_FEATURES = 1024
NARROW_IN_FEATURES = 2048
NARROW_ROWS_MAX = 1024
# Without AMX tiles, on a CPU with AVX-512 BF16 (the kernel's vdpbf16ps passes of 4 rows x 6 tiles),
# every layer of at most NARROW_IN_FEATURES inputs keeps the kernel up to VECTOR_ROWS_MAX rows:
# SmolLM2's layers on a 2-core AMD EPYC Zen 4, weights streaming (benchmarks/bf16_gemm.py --rows
# 256,512,1024,2048), oneDNN's time over the kernel's 1.02-1.11x at 256-2048 rows (lm_head 1.03x at
# 512); W64 offline with its 512-token prompt chunks on the kernel 1.02x (4 alternating pairs). More
# inputs: each pass re-reads the chunk's activations, which no longer stay in cache.
VECTOR_ROWS_MAX = 2048

# Registration is process-wide by nature (torch's operator registry); this module does it once,
# on import. Library.define/impl rather than @custom_op, whose per-call checks cost ~20 us: a
# forward makes 121 linear calls.
_LIBRARY = torch.library.Library("kvserve_linear", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, SymInt out_features) -> Tensor")


# The overload itself, looked up once: calling the packet (torch.ops.mkldnn._linear_pointwise)
# resolves the overload from the arguments on every one of the 121 calls a step makes. (None in a
# torch built without oneDNN, where nothing is packed and this op never runs.)
_LINEAR_POINTWISE_PACKET = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_LINEAR_POINTWISE = None if _LINEAR_POINTWISE_PACKET is None else _LINEAR_POINTWISE_PACKET.default


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    return _LINEAR_POINTWISE(x, packed_weight, bias, "none", [], "")


def _fake_packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                        out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("kvserve_linear::packed_linear", _fake_packed_linear, lib=_LIBRARY)
packed_linear = torch.ops.kvserve_linear.packed_linear.default


def weight_packing_supported(dtype: torch.dtype, device: torch.device, float32: bool = False) -> bool:
    """oneDNN's bf16 kernels need AVX-512 (BF16 or AMX) or similar; elsewhere torch's own
    fallback is used and packing does not apply. Its fp32 kernels run wherever oneDNN does:
    `float32` packs float32 weights too."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype is torch.float32:
        return float32
    return dtype in PACKABLE_DTYPES and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_emulates_bf16(dtype: torch.dtype) -> bool:
    """Whether oneDNN would run a `dtype` layer in emulated bf16 (this CPU has no bf16 arithmetic)."""
    return dtype is torch.bfloat16 and not native_bf16_arithmetic()


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout, in kvserve's bf16 kernel's, or both
    (inference only: no gradients)."""

    def __init__(self, packed_weight: torch.Tensor | None, bias: torch.Tensor | None, in_features: int,
                 out_features: int, few_rows_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        if packed_weight is None and few_rows_weight is None:
            raise ValueError("PackedLinear needs oneDNN's packed weight, kvserve's bf16 kernel's, or both")
        if packed_weight is not None and not packed_weight.is_mkldnn:
            raise ValueError("PackedLinear needs a weight from torch.ops.mkldnn._reorder_linear_weight")
        self.in_features, self.out_features = in_features, out_features
        # A plain attribute: module.to()/state_dict() cannot handle an opaque tensor, and nothing
        # should move or save it (the dense weights it came from are what a checkpoint holds).
        # None: kvserve's kernel serves every row count.
        self.packed_weight = packed_weight
        # The same weights in kvserve's bf16 kernel's layout (pack_bf16), for FEW_ROWS_MAX rows or
        # fewer (every row count without oneDNN's); None where that kernel is unavailable or the
        # weights are not bf16.
        self.few_rows_weight = few_rows_weight
        # Rows up to which the kernel's copy serves where both copies exist (the kernel's larger
        # tile blocks are AMX's; elsewhere it stops at FEW_ROWS_MAX).
        self.few_rows_max = few_rows_limit(in_features, out_features, bf16_matrix_tiles())
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, few_rows_kernel: bool | None = None) -> PackedLinear:
        """`few_rows_kernel`: also pack bf16 weights for kvserve's bf16 kernel (None: where it is
        available). Where oneDNN would emulate bf16, that copy alone serves every row count."""
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if few_rows_kernel is None:
            few_rows_kernel = bf16_gemm_available()
        few_rows_weight = pack_bf16(weight) if few_rows_kernel and weight.dtype is torch.bfloat16 else None
        packed = None
        if few_rows_weight is None or not onednn_emulates_bf16(weight.dtype):
            # No batch-size hint: the layout then suits every row count (measured at 1 to 256 rows).
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        return cls(packed, bias, linear.in_features, linear.out_features, few_rows_weight)

    def _kernel_serves(self, x: torch.Tensor) -> bool:
        """Whether kvserve's bf16 kernel computes these rows (else oneDNN's packed matmul)."""
        return self.few_rows_weight is not None and (self.packed_weight is None
                                                     or x.numel() <= self.few_rows_max * self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_serves(x):
            return bf16_linear(x, self.few_rows_weight, self.bias, self.out_features)
        return packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of forward(x) (argmax's rules), computed without the [rows, N] output
        where kvserve's kernel serves these rows (an lm_head's logits are never written: greedy
        sampling needs only the argmax); None where forward would take another path or add a bias."""
        if self.bias is not None or not self._kernel_serves(x):
            return None
        return bf16_linear_argmax(x, self.few_rows_weight, self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of forward(x) for a gated MLP's [gate | up] layer (its out_features two
        halves), the same bits, without the [rows, out_features] output where kvserve's kernel
        serves these rows; None where forward would take another path, add a bias, or the halves
        do not fall on the kernel's tiles of 16."""
        if (self.bias is not None or self.out_features % (2 * TILE) != 0 or x.dtype is not torch.bfloat16
                or not self._kernel_serves(x)):
            return None
        return bf16_linear_silu_mul(x, self.few_rows_weight, self.out_features // 2)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"few_rows_kernel={self.few_rows_weight is not None}, onednn={self.packed_weight is not None}")


def few_rows_limit(in_features: int, out_features: int, matrix_tiles: bool) -> int:
    """The most rows a layer gives kvserve's bf16 kernel when oneDNN's packed matmul is there too
    (`matrix_tiles`: the CPU has AMX; the kernel's tile route needs inputs in multiples of 32;
    without it, the vector passes: oneDNN's copy exists only where the CPU has AVX-512 BF16)."""
    if not matrix_tiles:
        return VECTOR_ROWS_MAX if in_features <= NARROW_IN_FEATURES else FEW_ROWS_MAX
    narrow = out_features <= NARROW_OUT_FEATURES and in_features <= NARROW_IN_FEATURES and in_features % 32 == 0
    return NARROW_ROWS_MAX if narrow else FEW_ROWS_MAX


def pack_linear_weights(model: nn.Module, few_rows_kernel: bool | None = None, float32: bool = False) -> int:
    """Replaces every nn.Linear of `model` whose weight oneDNN can pack by a PackedLinear, in
    place. Run it after any quantization (which swaps nn.Linear for its own modules) and before
    compiling. Returns how many layers were packed. `few_rows_kernel` as in PackedLinear.from_linear;
    `float32`: pack float32 weights too (left as they are otherwise)."""
    targets = _packing_targets(model, float32)
    with torch.inference_mode():
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear.from_linear(child, few_rows_kernel))
    return len(targets)


def _packing_targets(model: nn.Module, float32: bool = False) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and weight_packing_supported(child.weight.dtype, child.weight.device, float32)]


def packable_weight_bytes(model: nn.Module) -> int:
    """The bytes the few-row kernel's copies would add beside oneDNN's if pack_linear_weights made
    them: those of the bf16 weights it would pack, but where oneDNN would emulate bf16 (there the
    kernel's copy is the only one, adding nothing)."""
    return sum(child.weight.numel() * child.weight.element_size() for _, _, child in _packing_targets(model)
               if not onednn_emulates_bf16(child.weight.dtype))


def few_rows_weight_bytes(model: nn.Module) -> int:
    """The bytes of the few-row kernel's weight copies in `model` beside oneDNN's (which replace the
    dense weights, as a copy without oneDNN's does): memory that module.parameters() and buffers()
    do not count."""
    return sum(m.few_rows_weight.numel() * m.few_rows_weight.element_size() for m in model.modules()
               if isinstance(m, PackedLinear) and m.few_rows_weight is not None and m.packed_weight is not None)
