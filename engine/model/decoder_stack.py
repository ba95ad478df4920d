"""The forward every decoder family shares: embed the step's tokens, compute the rope tables
once, run each layer with its own cache and attention metadata, normalise. A family's model
provides `embed_tokens`, `rotary_emb`, `layers` and `norm`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvserve.kernels import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from kvserve.kernels import AttentionBackend


def run_decoder(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: list[AttentionMetadata], attention: AttentionBackend) -> torch.Tensor:
    """input_ids, positions: [T] tokens of many requests, flattened; one KV cache and one
    attention metadata per layer (layers of one group share theirs). Returns hidden [T, hidden]."""
    check_step_inputs(len(model.layers), input_ids, positions, kv_caches, attn_metadata)
    x = model.embed_tokens(input_ids)
    rope = model.rotary_emb(positions, x.dtype)
    for layer, kv_cache, meta in zip(model.layers, kv_caches, attn_metadata):
        x = layer(x, rope, kv_cache, meta, attention)
    return model.norm(x)


def check_step_inputs(num_layers: int, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      attn_metadata: list[AttentionMetadata]) -> None:
    """One cache and one metadata per layer, one position and one slot per token."""
    if len(kv_caches) != num_layers or len(attn_metadata) != num_layers:
        raise ValueError(f"need one KV cache and one attention metadata per layer: {num_layers}, "
                         f"got {len(kv_caches)} and {len(attn_metadata)}")
    if input_ids.shape != positions.shape or input_ids.shape[0] != attn_metadata[0].num_tokens:
        raise ValueError(f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)} and "
                         f"slot_mapping ({attn_metadata[0].num_tokens}) must all have one entry per token")
