"""How much memory the KV cache needs, and how many blocks a memory budget buys.

    KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes

GQA/MQA shrink it by num_heads / num_kv_heads against multi-head attention: Llama-2-70B keeps 8
KV heads for 64 query heads, so its cache is 8x smaller than an MHA model of the same shape.
Everything here counts bytes: a KV element's size comes in as `dtype_bytes` (the engine passes
its torch dtype's itemsize; `kvserve kv-size` maps its --kv-dtype names). Shapes come from the
presets below, or from a checkpoint's metadata, which the engine reads
(kvserve.engine.model.model_shape) with the same code that builds its ModelConfig.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvserve.paging.block_allocator import validate_block_size
from kvserve.paging.kv_cache_spec import FullAttentionSpec, bytes_per_block, group_layers

@dataclass(frozen=True)
class ModelShape:
    """The attention shape that decides KV size."""

    name: str
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        counts = {"num_layers": self.num_layers, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        for field_name, count in counts.items():
            if count < 1:
                raise ValueError(f"{self.name}: {field_name} must be at least 1, got {count}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: {self.num_heads} query heads cannot be grouped over {self.num_kv_heads} KV heads "
                "(num_heads must be a multiple of num_kv_heads)"
            )

    @property
    def gqa_factor(self) -> int:
        """Query heads per KV head: 1 for MHA, num_heads for MQA."""
        return self.num_heads // self.num_kv_heads

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def as_mha(self) -> ModelShape:
        """The same model with one KV head per query head (what GQA saves against)."""
        return replace(self, num_kv_heads=self.num_heads)

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer: 2 * L * n_kv_heads * head_dim * dtype_bytes (the layers' specs,
        as the engine plans its cache from them)."""
        if dtype_bytes < 1:
            raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes}")
        return sum(spec.bytes_per_token for spec in self.layer_specs(dtype_bytes))

    def kv_cache_bytes(self, dtype_bytes: int, num_tokens: int, batch: int = 1) -> int:
        return self.bytes_per_token(dtype_bytes) * num_tokens * batch

    def bytes_per_block(self, dtype_bytes: int, block_size: int = 16) -> int:
        return self.bytes_per_token(dtype_bytes) * block_size

    def layer_specs(self, dtype_bytes: int, dtype: str = "") -> list[FullAttentionSpec]:
        """The KV cache spec of every layer, as the engine plans the cache from them."""
        spec = FullAttentionSpec(self.num_kv_heads, self.head_dim, dtype or f"{dtype_bytes}-byte element", dtype_bytes)
        return [spec] * self.num_layers


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("gpt2", num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64, max_position_embeddings=1024),
        ModelShape("llama-7b", num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096),
        ModelShape("llama-70b", num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=4096),
        ModelShape("gpt3-175b", num_layers=96, num_heads=96, num_kv_heads=96, head_dim=128, max_position_embeddings=2048),
        ModelShape("smollm2-135m", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192),
    )
}


def num_blocks_for_memory(memory_bytes: int, shape: ModelShape, dtype_bytes: int, block_size: int = 16) -> int:
    """Whole blocks that fit in `memory_bytes` (K and V of every layer), as the engine plans them."""
    if memory_bytes < 0:
        raise ValueError(f"memory must be >= 0 bytes, got {memory_bytes}")
    validate_block_size(block_size)
    return memory_bytes // bytes_per_block(group_layers(shape.layer_specs(dtype_bytes)), block_size)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-z]*)\s*$")


def parse_memory_size(text: str) -> int:
    """'80GB' (10^9), '74.5GiB' (2^30), '24e9' or '1048576' (bytes) -> bytes."""
    match = _SIZE.match(text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}: write a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GB")
    size = round(float(match.group(1)) * _UNITS[match.group(2)])
    if size < 1:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return size
