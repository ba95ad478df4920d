"""How much memory the KV cache needs, and how many blocks a memory budget buys.

    KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes

GQA/MQA shrink it by num_heads / num_kv_heads against multi-head attention: Llama-2-70B keeps 8
KV heads for 64 query heads, so its cache is 8x smaller than an MHA model of the same shape.
A sliding-window layer (window w) keeps only its last w tokens, a rolling buffer whatever the
context: Mistral 7B v0.1 (every layer w = 4,096) needs 0.54 GB in fp16 at 32k tokens, 1/8 of
the 4.29 GB its layers would hold as global ones; Gemma 3 keeps 5 of every 6 layers at w = 1,024.
Latent attention (MLA: DeepSeek-V2/V3) keeps one vector per token and layer instead:

    latent bytes per token = layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes

against 2 x heads x head_dim per layer for the MHA cache of the same model (its keys are
qk_nope + qk_rope wide, its values v_head_dim).
Everything here counts bytes: a KV element's size comes in as `dtype_bytes` (the engine passes
its torch dtype's itemsize; `kvserve kv-size` maps its --kv-dtype names), with the dtype's name
where its rows carry scales (`dtype="int8"`: 4 more bytes per token, KV head and K or V:
kv_cache_spec.ROW_SCALE_BYTES). Shapes come from the
presets below, or from a checkpoint's metadata, which the engine reads
(kvserve.engine.model.model_shape) with the same code that builds its ModelConfig.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvserve.paging.block_allocator import validate_block_size
from kvserve.paging.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowSpec, blocks_per_request, bytes_per_block, group_layers

@dataclass(frozen=True)
class ModelShape:
    """The attention shape that decides KV size."""

    name: str
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int  # of the keys
    max_position_embeddings: int | None = None
    # How many of the layers attend within a sliding window of `sliding_window` tokens (the
    # rest are global: full attention).
    sliding_window: int | None = None
    num_window_layers: int = 0
    # Latent attention: each layer caches kv_lora_rank + qk_rope_head_dim values per token.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    v_head_dim: int | None = None  # the values' head_dim where it differs from the keys'

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
        if not 0 <= self.num_window_layers <= self.num_layers:
            raise ValueError(f"{self.name}: {self.num_window_layers} window layers of {self.num_layers} layers")
        if (self.sliding_window is None) != (self.num_window_layers == 0) or (self.sliding_window or 1) < 1:
            raise ValueError(f"{self.name}: window layers need a positive sliding_window and a window needs layers, "
                             f"got {self.num_window_layers} layers of window {self.sliding_window}")

    @property
    def num_global_layers(self) -> int:
        return self.num_layers - self.num_window_layers

    @property
    def gqa_factor(self) -> int:
        """Query heads per KV head: 1 for MHA, num_heads for MQA."""
        return self.num_heads // self.num_kv_heads

    @property
    def attention_kind(self) -> str:
        if self.kv_lora_rank is not None:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def cache_saving(self) -> float:
        """How many times smaller the cache is than the same model's MHA cache."""
        return self.as_mha().bytes_per_token(1) / self.bytes_per_token(1)

    def as_mha(self) -> ModelShape:
        """The same model with one KV head per query head (what GQA and MLA save against)."""
        return replace(self, num_kv_heads=self.num_heads, kv_lora_rank=None)

    def as_global(self) -> ModelShape:
        """The same model with every layer global (what the windows save against)."""
        return replace(self, sliding_window=None, num_window_layers=0)

    def bytes_per_token(self, dtype_bytes: int, *, dtype: str = "") -> int:
        """K and V for every layer: 2 * L * n_kv_heads * head_dim * dtype_bytes (the layers' specs,
        as the engine plans its cache from them; an int8 cache's scales included)."""
        if dtype_bytes < 1:
            raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes}")
        return sum(spec.bytes_per_token for spec in self.layer_specs(dtype_bytes, dtype))

    def kv_cache_bytes(self, dtype_bytes: int, num_tokens: int, batch: int = 1, *, dtype: str = "") -> int:
        """The KV a context of `num_tokens` keeps: every token in the global layers, the last
        `sliding_window` of them in the window layers."""
        return (self.global_bytes(dtype_bytes, num_tokens, batch, dtype=dtype)
                + self.window_bytes(dtype_bytes, num_tokens, batch, dtype=dtype))

    def global_bytes(self, dtype_bytes: int, num_tokens: int, batch: int = 1, *, dtype: str = "") -> int:
        return self.layer_bytes_per_token(dtype_bytes, dtype=dtype) * self.num_global_layers * num_tokens * batch

    def window_bytes(self, dtype_bytes: int, num_tokens: int, batch: int = 1, *, dtype: str = "") -> int:
        kept = min(num_tokens, self.sliding_window or 0)
        return self.layer_bytes_per_token(dtype_bytes, dtype=dtype) * self.num_window_layers * kept * batch

    def layer_bytes_per_token(self, dtype_bytes: int, *, dtype: str = "") -> int:
        """One layer's K and V of one token."""
        return self.bytes_per_token(dtype_bytes, dtype=dtype) // self.num_layers

    def bytes_per_block(self, dtype_bytes: int, block_size: int = 16, *, dtype: str = "") -> int:
        return self.bytes_per_token(dtype_bytes, dtype=dtype) * block_size

    def layer_specs(self, dtype_bytes: int, dtype: str = "") -> list[KVCacheSpec]:
        """The KV cache spec of every layer, as the engine plans the cache from them (the window
        layers first: where they sit among the global ones changes no size)."""
        name = dtype or f"{dtype_bytes}-byte element"
        if self.kv_lora_rank is not None:
            return [MLAAttentionSpec(self.kv_lora_rank, self.qk_rope_head_dim, name, dtype_bytes)] * self.num_layers
        # Keys and values of different widths (an MLA model's MHA equivalent) cost as much as
        # both at their mean width: the spec's head_size is per K and per V.
        head_size = self.head_dim if self.v_head_dim is None else (self.head_dim + self.v_head_dim) / 2
        if head_size != int(head_size):
            raise ValueError(f"{self.name}: keys of {self.head_dim} and values of {self.v_head_dim} dims have no whole mean width")
        full = FullAttentionSpec(self.num_kv_heads, int(head_size), name, dtype_bytes)
        if not self.num_window_layers:
            return [full] * self.num_layers
        window = SlidingWindowSpec(self.num_kv_heads, int(head_size), name, dtype_bytes, sliding_window=self.sliding_window)
        return [window] * self.num_window_layers + [full] * self.num_global_layers


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("gpt2", num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64, max_position_embeddings=1024),
        ModelShape("llama-7b", num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096),
        ModelShape("llama-70b", num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=4096),
        ModelShape("gpt3-175b", num_layers=96, num_heads=96, num_kv_heads=96, head_dim=128, max_position_embeddings=2048),
        ModelShape("smollm2-135m", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192),
        # Every layer windowed (config.json's sliding_window: 4096).
        ModelShape("mistral-7b-v0.1", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                   max_position_embeddings=32768, sliding_window=4096, num_window_layers=32),
        # Gemma 2: window and global layers alternate.
        ModelShape("gemma-2-9b", num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
                   max_position_embeddings=8192, sliding_window=4096, num_window_layers=21),
        # Gemma 3: 5 window layers for each global one (sliding_window_pattern 6).
        ModelShape("gemma-3-4b", num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256,
                   max_position_embeddings=131072, sliding_window=1024, num_window_layers=29),
        ModelShape("gemma-3-27b", num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128,
                   max_position_embeddings=131072, sliding_window=1024, num_window_layers=52),
        ModelShape("qwen3-8b", num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960),
        # DeepSeek's config.json: qk_nope_head_dim 128 + qk_rope_head_dim 64 = 192-dim keys, 128-dim values.
        ModelShape("deepseek-v2-lite", num_layers=27, num_heads=16, num_kv_heads=16, head_dim=192, max_position_embeddings=163840,
                   kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128),
        ModelShape("deepseek-v3", num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192, max_position_embeddings=163840,
                   kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128),
    )
}


def num_blocks_for_memory(memory_bytes: int, shape: ModelShape, dtype_bytes: int, block_size: int = 16, *,
                          dtype: str = "") -> int:
    """Whole blocks that fit in `memory_bytes` (K and V of every layer), as the engine plans them."""
    if memory_bytes < 0:
        raise ValueError(f"memory must be >= 0 bytes, got {memory_bytes}")
    validate_block_size(block_size)
    return memory_bytes // bytes_per_block(group_layers(shape.layer_specs(dtype_bytes, dtype)), block_size)


def blocks_per_decoding_request(shape: ModelShape, dtype_bytes: int, num_tokens: int, block_size: int = 16, *,
                                dtype: str = "") -> int:
    """Blocks a request of `num_tokens` tokens holds between decode steps, as the engine's layer
    groups hold them: all of its blocks per global group, ceil((w - 1) / block_size) + 1 per
    window group."""
    specs = [group.spec for group in group_layers(shape.layer_specs(dtype_bytes, dtype))]
    return blocks_per_request(specs, num_tokens, block_size, 1)


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
