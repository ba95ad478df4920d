"""The shape of a decoder model, as its family's parser reads it from config.json or GGUF
metadata (engine/model/registry.py picks the family; weights are never read for it).

One frozen dataclass describes the Llama family (Llama, Mistral, Qwen2 differ only in qkv bias,
rope settings and defaults) and what every family shares: vocabulary, layers, heads, context,
end-of-generation ids. A family with more to say subclasses it with its own fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvserve.engine.model.model_errors import ModelConfigError
from kvserve.paging.kv_sizing import ModelShape

__all__ = ["ModelConfig", "end_of_generation_ids"]

# rope_type -> the keys transformers requires for it.
ROPE_SCALING_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings"),
        "longrope": ("long_factor", "short_factor", "original_max_position_embeddings"),
    }
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the registry's name for it: "llama", "mistral", "qwen2", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None  # {"rope_type": "linear"|"dynamic"|"llama3"|"yarn"|"longrope", ...}
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2); o_proj never has one
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Per-frequency rope divisors (head_dim / 2 of them): how llama.cpp stores Llama 3.1's llama3
    # scaling in a GGUF (the `rope_freqs.weight` tensor), applied on top of rope_scaling.
    rope_freq_factors: tuple[float, ...] | None = None
    # Every layer attends to the last `sliding_window` positions, its own included (Mistral 7B
    # v0.1's 4,096); None: full attention.
    sliding_window: int | None = None
    # The layers that do (a windowed Qwen2's from max_window_layers on), the others attending to
    # everything; None: every layer.
    window_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) for GQA"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelConfigError(f"sliding_window must be positive (or absent), got {self.sliding_window}")
        if self.window_layers is not None and (self.sliding_window is None or not self.window_layers
                                               or not all(0 <= i < self.num_layers for i in self.window_layers)):
            raise ModelConfigError(f"window_layers {self.window_layers} must name some of the {self.num_layers} layers, "
                                   f"with a sliding_window (got {self.sliding_window})")
        if self.head_dim % 2:
            raise ModelConfigError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ModelConfigError(f"rope_theta and rms_norm_eps must be positive, got {self.rope_theta}, {self.rms_norm_eps}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in ROPE_SCALING_KEYS:
                raise ModelConfigError(
                    f"rope scaling {rope_type!r} is not supported; supported: {', '.join(ROPE_SCALING_KEYS)}"
                )
            missing = [k for k in ROPE_SCALING_KEYS[rope_type] if k not in self.rope_scaling]
            if missing:
                raise ModelConfigError(f"{rope_type} rope scaling needs {', '.join(missing)}")
            # Freeze the mapping so the dataclass really is immutable.
            object.__setattr__(self, "rope_scaling", MappingProxyType(dict(self.rope_scaling)))
        if not all(0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ModelConfigError(f"eos token ids {self.eos_token_ids} lie outside the vocabulary ({self.vocab_size})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The tokens a query of `layer` attends to (itself included); None: all of them."""
        return self.sliding_window if self.window_layers is None or layer in self.window_layers else None

    def kv_shape(self, name: str = "model") -> ModelShape:
        """The attention shape that sizes the KV cache (bytes per token and per block live there)."""
        windowed = sum(self.layer_window(i) is not None for i in range(self.num_layers))
        return ModelShape(name, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.max_position_embeddings,
                          sliding_window=self.sliding_window if windowed else None, num_window_layers=windowed)


def end_of_generation_ids(config: ModelConfig, tokenizer_eos_token_id: int | None) -> tuple[int, ...]:
    """Every token that ends a reply: the tokenizer's EOS first, then the model's own list (GGUF
    eos/eot, config.json and generation_config.json eos_token_id). Instruct models often end turns
    with a token that is not the tokenizer's EOS (Llama 3's <|eot_id|>), so stopping on one id
    alone lets such a reply run to max_tokens."""
    first = () if tokenizer_eos_token_id is None else (tokenizer_eos_token_id,)
    return tuple(dict.fromkeys(first + config.eos_token_ids))


