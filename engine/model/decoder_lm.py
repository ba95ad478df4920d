"""The decoder-only language model the families beyond Llama share (Qwen3, Gemma 2/3, Phi-3):

    x = embed_tokens(ids) [* embed_scale]           Gemma scales embeddings by sqrt(hidden)
    ropes = each rope's (cos, sin) of the positions  once per forward; layer i gets ropes[rope_of_layer[i]]
    x = layer(x, rope, kv_cache, meta, attention)    per layer: the family's block
    hidden = norm(x)
    logits = lm_head(hidden) [soft-capped]           Gemma 2: cap * tanh(logits / cap)

What a family brings is its blocks (each with a `self_attn` that declares its KV cache spec), its
final norm and its rope tables: Gemma 3's local and global layers use two rope bases, and each
layer is handed its own as a per-call input, so that all layers still share one compiled graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from kvserve.engine.model.decoder_stack import check_step_inputs
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.packed_linear import PackedLinear
from kvserve.engine.model.parallel_layers import lm_head, vocab_embedding
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel
from kvserve.kernels import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from kvserve.kernels import AttentionBackend
    from kvserve.paging import KVCacheSpec


class FusedLayers(Protocol):
    """Runs every layer of a step at once (engine/model/fused_decode.py), for the steps it fits."""

    def fits(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], kv_caches: list[KVCache],
             attn_metadata: list[AttentionMetadata]) -> bool: ...

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor: ...


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's bound on logits (smooth, ~x for |x| << cap)."""
    return torch.tanh(x / cap) * cap


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig, layers: Sequence[nn.Module], norm: nn.Module,
                 rotary_embs: Sequence[nn.Module], parallel: TensorParallel = SINGLE, *,
                 rope_of_layer: Sequence[int] | None = None, embed_scale: float | None = None,
                 final_logit_soft_cap: float | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, parallel)
        self.rotary_embs = nn.ModuleList(rotary_embs)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, parallel,
                               tied_to=self.embed_tokens if config.tie_word_embeddings else None)
        self.rope_of_layer = tuple(rope_of_layer) if rope_of_layer is not None else (0,) * len(self.layers)
        if len(self.rope_of_layer) != len(self.layers) or not all(0 <= r < len(rotary_embs) for r in self.rope_of_layer):
            raise ValueError(f"rope_of_layer {self.rope_of_layer} must name one of {len(rotary_embs)} ropes per layer")
        self.embed_scale = embed_scale
        self.final_logit_soft_cap = final_logit_soft_cap
        # All layers of a small step in one call where the runner set it up (engine/model/fused_decode.py).
        self.fused_layers: FusedLayers | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: list[AttentionMetadata], attention: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] tokens of many requests, flattened; one KV cache and one
        attention metadata per layer (layers of one group share theirs). Returns hidden [T, hidden]."""
        check_step_inputs(len(self.layers), input_ids, positions, kv_caches, attn_metadata)
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # In the model dtype, as transformers rounds it (sqrt(2304) in bf16 is 48.0, not 48.0000...).
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        ropes = [rotary(positions, x.dtype) for rotary in self.rotary_embs]
        fused = self.fused_layers
        if fused is not None and fused.fits(x, ropes[0], kv_caches, attn_metadata):
            return self.norm(fused(x, ropes[0], kv_caches, attn_metadata[0]))
        for layer, rope_index, kv_cache, meta in zip(self.layers, self.rope_of_layer, kv_caches, attn_metadata):
            x = layer(x, ropes[rope_index], kv_cache, meta, attention)
        return self.norm(x)

    def kv_cache_specs(self, dtype: str, dtype_bytes: int) -> list[KVCacheSpec]:
        """What each layer keeps in the KV cache, from the layers themselves (a tensor-parallel
        rank's layers hold its share of the heads; window layers declare their window)."""
        return [layer.self_attn.kv_cache_spec(dtype, dtype_bytes) for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model's dtype (the sampler upcasts
        the batches that need it)."""
        logits = self.lm_head(hidden)
        return logits if self.final_logit_soft_cap is None else soft_cap(logits, self.final_logit_soft_cap)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of compute_logits(hidden) where the lm_head gives it without the
        logits (PackedLinear.greedy_tokens); None elsewhere (a soft cap, another head)."""
        if self.final_logit_soft_cap is not None or not isinstance(self.lm_head, PackedLinear):
            return None
        return self.lm_head.greedy_tokens(hidden)


class PreNormBlock(nn.Module):
    """Llama's block, with the family's attention and MLP:
    h = x + self_attn(input_layernorm(x));  out = h + mlp(post_attention_layernorm(h))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], kv_cache: KVCache, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, attention)
        return h + self.mlp(self.post_attention_layernorm(h))
