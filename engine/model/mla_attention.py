"""Multi-head latent attention (DeepSeek-V2/V3), in the absorbed form, through the paged kernels.

Each token's cache entry is one latent: c = RMSNorm(W_DKV x) (kv_lora_rank values) and the
decoupled rope key k_R = rope(W_KR x) (qk_rope_head_dim values), shared by every head. Head h's
key and value are decompressed from c by kv_b_proj: k_h = [W_UK_h c ; k_R], v_h = W_UV_h c. Then

    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rope_h . k_R = [W_UK_h^T q_nope_h ; q_rope_h] . [c ; k_R]
    sum_s p_s v_h,s = W_UV_h (sum_s p_s c_s)

so attention is MQA over the cached latents, with one shared KV head whose keys are [c ; k_R]
(kv_lora_rank + rope values) and whose values are c (its first kv_lora_rank values, a view of
the same memory): the query absorbs W_UK, and W_UV is applied to the attention's output. The
same form serves prefill chunks, prefix hits and decodes, so any step's context comes from the
paged cache alone; nothing per head is ever cached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.engine.model.deepseek_config import DeepseekConfig
from kvserve.engine.model.protocol import Rope
from kvserve.engine.model.rms_norm import RMSNorm
from kvserve.engine.model.rope import apply_rotary
from kvserve.kernels import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from kvserve.kernels import AttentionBackend


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): DeepSeek's interleaved
    rope is then the rotate-half rope (both q and k are reordered alike; dot products keep)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class UpProjection(nn.Module):
    """kv_b_proj's weight [heads x (nope + v), kv_lora_rank], read as W_UK and W_UV: never run as a
    linear layer, so not an nn.Linear (weight packing and quantization leave it whole)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MLAAttention(nn.Module):
    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_head_dim = config.qk_nope_head_dim, config.v_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.interleaved = config.rope_interleave
        self.scale = config.softmax_scale
        q_out = self.num_heads * self.qk_head_dim
        self.q_lora = config.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = nn.Linear(config.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.rope_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = UpProjection(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim))
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=config.attention_bias)

    def project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q_nope [T, H, nope], q_rope [T, H, R] (rotated), latent [T, 1, L + R]
        (the normalised c and the rotated k_R: what the cache keeps)."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = q.view(-1, self.num_heads, self.qk_head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = k_rope.unsqueeze(1)
        if self.interleaved:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rotary(q_rope, k_rope, *rope)
        latent = torch.cat((self.kv_a_layernorm(c).unsqueeze(1), k_rope), dim=-1)
        return q_nope, q_rope, latent

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, L] and W_UV [H, v, L], views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim:]

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        q_nope, q_rope, latent = self.project(x, rope)
        attention.write_kv_cache(latent, latent[..., : self.kv_lora_rank], kv_cache, meta)
        w_uk, w_uv = self.up_projections()
        # Batched over heads: [H, T, nope] @ [H, nope, L] -> [H, T, L].
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_rope), dim=-1).contiguous()  # [T, H, L + R]
        out_latent = attention.paged_attention(query, kv_cache, meta, self.scale)  # [T, H, L]
        out = torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_head_dim))
