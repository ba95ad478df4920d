"""The Llama-family forward (Llama, Mistral, Qwen2) over a flattened batch of many requests.

Each block reads like the math:  h = x + Attention(RMSNorm(x));  out = h + MLP(RMSNorm(h)).
Attention writes this step's K/V into the paged cache and reads the whole context back through
the block tables; which kernel does it is the caller's choice (`attention`), so the forward is
the same on CPU and GPU. Q/K/V and gate/up are fused into one matmul each: fewer, larger GEMMs,
which is what both AMX on CPU and tensor cores want for small batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.attention_metadata import AttentionMetadata
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from kvserve.kernels import AttentionBackend

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache): [num_blocks, Hkv, block_size, D]
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin): [T, D]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, then scale in the model dtype (as transformers).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        key_cache, value_cache = kv_cache
        attention.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = attention.paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, num_decodes=meta.num_decodes,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] tokens of many requests, flattened. Returns hidden [T, hidden]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need one (key, value) cache per layer: {len(self.layers)}, got {len(kv_caches)}")
        if input_ids.shape != positions.shape or input_ids.shape[0] != attn_metadata.num_tokens:
            raise ValueError(f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)} and "
                             f"slot_mapping ({attn_metadata.num_tokens}) must all have one entry per token")
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, attn_metadata, attention)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (the rows to sample from) -> logits [N, vocab] in the model's dtype.
        No float32 copy here: a greedy batch needs only an argmax, which upcasting cannot change,
        and the sampler upcasts the batches that need more (64 bf16 rows: 6 MB read, 12 MB
        written per step otherwise)."""
        return self.lm_head(hidden)
