"""Small steps of a Llama-shaped bf16 model on the CPU as one C++ call for all its layers.

A decode step of a small model spends much of its time between the matmuls: the compiled forward
enters Python for each of a layer's ~12 ops and fused kernels (SmolLM2, measured in the engine:
~90 us a layer at one row, ~135 us at 64 rows; 2.7 and 4.1 ms a step). kvserve's bf16 kernel
library has the whole Llama block as one op (`decoder_layers` in kernels/csrc/cpu_bf16_gemm.cpp,
the same kernels the compiled graph calls, and its fused elementwise code reproduced in the same
order: same bits), so a step whose rows all fit the few-row linear kernel runs its layers with no
Python between them. Everything else keeps the compiled layers: larger steps (prompt chunks past
the kernel's rows), other block shapes, caches with scales, windows, soft caps, tensor parallelism.

`FusedDecodeLayers.build(model, attention)` says whether a model qualifies (once, after prepack and
compile); `fits(...)` whether a step does (per step, on sizes and dtypes only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.engine.model.decoder_lm import DecoderLM, PreNormBlock
from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model.packed_linear import PackedLinear
from kvserve.engine.model.rms_norm import RMSNorm
from kvserve.engine.model.self_attention import SelfAttention
from kvserve.kernels import AttentionMetadata, KVCache, TorchAttentionBackend
from kvserve.kernels.cpu_bf16_gemm import decoder_layers

if TYPE_CHECKING:
    from kvserve.kernels import AttentionBackend

# The op's vector code works on whole 32-element groups of the hidden size and head dim.
ALIGNMENT = 32


def _kernel_linear(module: object) -> PackedLinear | None:
    """`module` as a bias-free PackedLinear with the few-row kernel's weights, else None."""
    if type(module) is PackedLinear and module.few_rows_weight is not None and module.bias is None:
        return module
    return None


@dataclass(frozen=True)
class _Block:
    """What the op needs of one plain Llama block, and the shape every block must share."""

    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    shape: tuple[int, int, int, int, int, float, float]  # heads, kv heads, head_dim, hidden, intermediate, eps, scale

    @classmethod
    def of(cls, layer: object) -> _Block | None:
        """None where `layer` is anything but the plain block: q/k norms, biases, a window, a soft
        cap, another activation or norm, linears not on the few-row kernel (unpacked, quantized)."""
        if type(layer) is not PreNormBlock:
            return None
        attn, mlp, norms = layer.self_attn, layer.mlp, (layer.input_layernorm, layer.post_attention_layernorm)
        if (type(attn) is not SelfAttention or attn.q_norm is not None or attn.sliding_window is not None
                or attn.soft_cap != 0.0 or type(mlp) is not GatedMLP or not mlp.cpu_silu_kernel
                or any(type(norm) is not RMSNorm or norm.weight.dtype is not torch.bfloat16 for norm in norms)
                or norms[0].eps != norms[1].eps):
            return None
        linears = [_kernel_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(linear is None for linear in linears):
            return None
        hidden = norms[0].weight.shape[0]
        shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, hidden, mlp.intermediate_size, float(norms[0].eps),
                 float(attn.scale))
        return cls(*linears, norms[0].weight.detach(), norms[1].weight.detach(), shape)


@dataclass(frozen=True, eq=False)
class FusedDecodeLayers:
    """A qualifying model's per-layer tensors, gathered once, and the rows its steps may have."""

    blocks: tuple[_Block, ...]
    max_rows: int  # the most rows every linear layer gives the few-row kernel

    @classmethod
    def build(cls, model: object, attention: AttentionBackend) -> FusedDecodeLayers | None:
        """The plan for `model` (after prepack), or None where any layer differs from the plain
        Llama block the op computes, or the attention is not the native CPU kernel on plain caches."""
        if (not isinstance(model, DecoderLM) or not isinstance(attention, TorchAttentionBackend)
                or not attention.native or attention.k_scale is not None or attention.v_scale is not None
                or model.embed_scale is not None or len(model.rotary_embs) != 1 or model.dtype is not torch.bfloat16):
            return None
        blocks = tuple(_Block.of(layer) for layer in model.layers)
        if not blocks or any(block is None or block.shape != blocks[0].shape for block in blocks):
            return None
        heads, kv_heads, head_dim, hidden = blocks[0].shape[:4]
        if hidden % ALIGNMENT or head_dim % ALIGNMENT or heads % kv_heads:
            return None
        rows = min(_kernel_rows(linear) for b in blocks for linear in (b.qkv, b.o, b.gate_up, b.down))
        return cls(blocks, rows)

    def fits(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], kv_caches: list[KVCache],
             attn_metadata: list[AttentionMetadata]) -> bool:
        """Whether this step can run through the op: rows within the kernel's, plain bf16 caches,
        one metadata for all layers, full attention, a rope as wide as the heads."""
        meta = attn_metadata[0]
        return (x.shape[0] <= self.max_rows and x.dtype is torch.bfloat16 and x.device.type == "cpu"
                and len(rope) == 2 and rope[0].shape[-1] == self.blocks[0].shape[2] and meta.sliding_window == 0
                and all(m is meta for m in attn_metadata)
                and all(len(cache) == 2 and cache[0].dtype is torch.bfloat16 for cache in kv_caches))

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor:
        """The last layer's output for the step: what the model's layers would return."""
        heads, kv_heads, _, _, intermediate, eps, scale = self.blocks[0].shape
        b = self.blocks
        return decoder_layers(
            x.contiguous(), rope[0].contiguous(), rope[1].contiguous(), [k.input_norm for k in b],
            [k.qkv.few_rows_weight for k in b], [k.o.few_rows_weight for k in b], [k.post_norm for k in b],
            [k.gate_up.few_rows_weight for k in b], [k.down.few_rows_weight for k in b],
            [cache[0] for cache in kv_caches], [cache[1] for cache in kv_caches], meta, heads, kv_heads, intermediate,
            eps, scale)


def _kernel_rows(linear: PackedLinear) -> int:
    """Rows up to which `linear` runs the few-row kernel (PackedLinear.forward's rule)."""
    return linear.few_rows_max if linear.packed_weight is not None else 1 << 62
