"""What the runner and the compile wrapper may rely on in a decoder model, whatever its family.

    model(input_ids, positions, kv_caches, attn_metadata, attention) -> hidden [T, hidden]
        (one KV cache and one attention metadata per layer: its layer group's)
    model.compute_logits(hidden [N, hidden]) -> logits [N, vocab]   (model dtype)
    model.greedy_tokens(hidden [N, hidden]) (optional) -> [N] int64 or None: each row's argmax of
        compute_logits(hidden), where the model's head gives it without the logits (None: it cannot;
        the runner then samples from compute_logits)
    model.layers: nn.ModuleList; each called as layer(x, rope, kv_cache, meta, attention)
    model.dtype: the dtype of its hidden states (and of the rope tables it passes the layers)
    model.compiles (optional, default True): False for a model the compiled forward cannot run
        (its layers are not all alike): the engine runs it eagerly
    model.kv_cache_specs(dtype, dtype_bytes) -> one KVCacheSpec per layer (paging/kv_cache_spec.py):
        what each layer keeps in the cache, from the layers themselves (a tensor-parallel rank's
        layers hold its share of the heads); the runner groups and sizes the cache from it

`rope` is the tuple of tables the model computes once per forward, in its dtype, and hands every
layer (Llama: cos and sin of the step's positions); the compile wrapper treats it as a per-call
input and reads only its first table's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from kvserve.kernels import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from kvserve.kernels import AttentionBackend
    from kvserve.paging import KVCacheSpec

Rope = tuple[torch.Tensor, ...]  # per model: Llama's (cos, sin) tables [T, D]


@runtime_checkable
class DecoderLayer(Protocol):
    def __call__(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                 attention: AttentionBackend) -> torch.Tensor: ...


@runtime_checkable
class CausalLM(Protocol):
    layers: nn.ModuleList

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 attn_metadata: list[AttentionMetadata], attention: AttentionBackend) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def kv_cache_specs(self, dtype: str, dtype_bytes: int) -> list[KVCacheSpec]: ...

    def parameters(self, recurse: bool = True) -> Any: ...

    def modules(self) -> Any: ...
