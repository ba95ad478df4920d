"""Self-attention over the paged KV cache, with the options the families beyond Llama need:
q/k RMSNorm per head (Qwen3, Gemma 3), partial rotary (Phi-3: the rope tables are narrower than a
head), a score scale other than 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar), a cap on the
scores (Gemma 2's soft-capping) and a layer's sliding window.

    q, k, v = split(qkv_proj(x))        one fused matmul; column-parallel under TP (whole heads)
    q, k    = q_norm(q), k_norm(k)      per head, over head_dim (where the family has them)
    q, k    = rope(q, k)                the tables this layer was handed (its rope base)
    write k, v into the cache; out = attention(q, cache) ; o_proj(out)

Every option is fixed when the layer is built, and equal for the layers that share a compiled
graph (engine/compilation.py drops guards on layer attributes): what differs between layers of one
model (Gemma 3's local and global rope bases) comes in through the per-call inputs instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.parallel_layers import column_parallel_linear, row_parallel_linear
from kvserve.engine.model.protocol import Rope
from kvserve.engine.model.rope import apply_rotary
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel
from kvserve.kernels import AttentionMetadata, KVCache
from kvserve.paging import FullAttentionSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from kvserve.kernels import AttentionBackend
    from kvserve.paging import KVCacheSpec


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel = SINGLE, *, scale: float | None = None,
                 qk_norm: Callable[[int], nn.Module] | None = None, sliding_window: int | None = None,
                 soft_cap: float | None = None) -> None:
        """`qk_norm(head_dim)` builds the q and k norms; `sliding_window`: the tokens a query of
        this layer sees (itself included), None for all of them; `soft_cap` c: scores s become
        c * tanh(s / c) before the softmax (Gemma 2's attn_logit_softcapping), None for none."""
        super().__init__()
        self.num_heads, self.num_kv_heads = parallel.local(config.num_heads), parallel.local(config.num_kv_heads)
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = config.head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.soft_cap = float(soft_cap or 0.0)  # the kernels' 0: no cap
        self.qkv_proj = column_parallel_linear(config.hidden_size, (config.q_size, config.kv_size, config.kv_size),
                                               config.attention_bias, parallel)
        self.o_proj = row_parallel_linear(config.q_size, config.hidden_size, parallel)
        self.q_norm = qk_norm(self.head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(self.head_dim) if qk_norm is not None else None

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        attention.write_kv_cache(k, v, kv_cache, meta)
        out = attention.paged_attention(q, kv_cache, meta, self.scale, self.soft_cap)
        return self.o_proj(out.reshape(-1, self.q_size))

    def kv_cache_spec(self, dtype: str, dtype_bytes: int) -> KVCacheSpec:
        """What this layer keeps per token (this rank's share of the KV heads): a window layer's
        group gives back the blocks that fall out of its window, and its step metadata carries
        the window to the kernels."""
        if self.sliding_window is not None:
            return SlidingWindowSpec(self.num_kv_heads, self.head_dim, dtype, dtype_bytes,
                                     sliding_window=self.sliding_window)
        return FullAttentionSpec(self.num_kv_heads, self.head_dim, dtype, dtype_bytes)
