"""The shape of a Llama-family model, read from config.json or GGUF metadata (never weights).

One frozen dataclass describes Llama, Mistral and Qwen2: they differ only in qkv bias, rope
settings and defaults, so one forward (engine/model/llama.py) serves all three.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvserve.engine.model.model_errors import (
    SUPPORTED_ARCHITECTURES,
    CorruptModelError,
    ModelConfigError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from kvserve.paging.kv_sizing import ModelShape

__all__ = ["ModelConfig", "UnsupportedArchitectureError", "end_of_generation_ids", "load_model_config",
           "model_config_from_hf_dict", "shape_from_hf_dict"]

# rope_type -> the keys transformers requires for it.
ROPE_SCALING_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    }
)
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None  # {"rope_type": "linear"|"dynamic"|"llama3", ...}
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2); o_proj never has one
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(self.architecture, "ModelConfig")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) for GQA"
            )
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

    def kv_shape(self, name: str = "model") -> ModelShape:
        """The attention shape that sizes the KV cache (bytes per token and per block live there)."""
        return ModelShape(name, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.max_position_embeddings)


def end_of_generation_ids(config: ModelConfig, tokenizer_eos_token_id: int | None) -> tuple[int, ...]:
    """Every token that ends a reply: the tokenizer's EOS first, then the model's own list (GGUF
    eos/eot, config.json and generation_config.json eos_token_id). Instruct models often end turns
    with a token that is not the tokenizer's EOS (Llama 3's <|eot_id|>), so stopping on one id
    alone lets such a reply run to max_tokens."""
    first = () if tokenizer_eos_token_id is None else (tokenizer_eos_token_id,)
    return tuple(dict.fromkeys(first + config.eos_token_ids))


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers 4 writes rope_theta + rope_scaling; transformers 5 writes rope_parameters."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list | tuple) else (int(value),)


def shape_from_hf_dict(name: str, hf: Mapping[str, Any]) -> ModelShape:
    """The KV-deciding fields of a config.json, under Llama's names or GPT-2's (n_layer, n_head,
    n_embd), for any family: `kvserve kv-size` plans for models the engine does not run."""
    layers = hf.get("num_hidden_layers", hf.get("n_layer"))
    heads = hf.get("num_attention_heads", hf.get("n_head"))
    hidden = hf.get("hidden_size", hf.get("n_embd"))
    if layers is None or heads is None or hidden is None:
        raise CorruptModelError(
            f"config {name!r} lacks the layer count, head count or hidden size "
            "(num_hidden_layers, num_attention_heads, hidden_size)"
        )
    heads = int(heads)
    try:
        return ModelShape(
            name=name,
            num_layers=int(layers),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hidden) // heads),
            max_position_embeddings=hf.get("max_position_embeddings", hf.get("n_positions")),
        )
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from exc


def model_config_from_hf_dict(hf: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (and generation_config.json, whose eos ids
    are often the complete list, e.g. Llama 3's <|eot_id|>)."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type", "")
    architecture = HF_ARCHITECTURES.get(archs[0]) if archs else model_type
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(archs[0] if archs else model_type or "<missing>", "config.json")
    if architecture == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ModelConfigError("Llama checkpoints with attention_bias/mlp_bias (o_proj/MLP biases) are not supported")
    shape = shape_from_hf_dict("config.json", hf)
    max_pos = int(hf.get("max_position_embeddings", 4096))
    sliding_window = hf.get("sliding_window")
    if architecture in ("mistral", "qwen2") and sliding_window and hf.get("use_sliding_window", architecture == "mistral"):
        # Paged attention here is full attention; within the window the two are identical, so we
        # serve only that much context rather than silently computing something else.
        max_pos = min(max_pos, int(sliding_window))
    theta, scaling = _rope_from_hf(hf)
    eos = _eos_ids(hf.get("eos_token_id"))
    for extra in _eos_ids((generation or {}).get("eos_token_id")):
        eos += (extra,) if extra not in eos else ()
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=architecture == "qwen2",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path} is not valid JSON ({exc}); re-download the model") from exc


def load_model_config(path: str | Path) -> ModelConfig:
    """From a .gguf file, an HF model directory or a config.json path. Reads metadata only."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from kvserve.engine.model.gguf_metadata import model_config_from_gguf, read_gguf

        return model_config_from_gguf(read_gguf(path), path)
    config_json = path / "config.json" if path.is_dir() else path
    if not config_json.is_file():
        raise ModelNotFoundError(f"{path}: expected a .gguf file, a model directory with config.json, or a config.json")
    generation_json = config_json.parent / "generation_config.json"
    generation = _read_json(generation_json) if generation_json.is_file() else None
    try:
        return model_config_from_hf_dict(_read_json(config_json), generation)
    except KeyError as exc:
        raise CorruptModelError(f"{config_json} lacks the required field {exc.args[0]!r}") from exc
