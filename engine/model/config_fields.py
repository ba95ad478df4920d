"""The ModelConfig fields every family reads the same way, from config.json or GGUF metadata;
a family's parser adds what is its own (engine/model/qwen3.py, gemma.py, phi3.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.engine.model.gguf_metadata import GGUFFields
from kvserve.engine.model.hf_config import eos_token_ids, rope_from_hf, shape_from_hf_dict
from kvserve.engine.model.model_errors import ModelConfigError


def refuse_yarn(values: dict[str, Any], family: str) -> None:
    """rope.py computes YaRN as transformers does, but it is verified only for DeepSeek here."""
    scaling = values.get("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn":
        raise ModelConfigError(f"rope scaling 'yarn' is not supported for {family} models")


def hf_config_fields(architecture: str, hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> dict[str, Any]:
    shape = shape_from_hf_dict("config.json", hf)
    theta, scaling = rope_from_hf(hf)
    return dict(
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
        **common_hf_fields(hf, generation),
    )


def common_hf_fields(hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fields every family's config.json spells alike (DeepSeek's parser reads them too)."""
    return dict(
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_token_ids(hf, generation),
    )


def gguf_config_fields(architecture: str, fields: GGUFFields) -> dict[str, Any]:
    shape = fields.shape()
    tokens = fields.general("tokenizer.ggml.tokens")
    eos, eot = fields.general("tokenizer.ggml.eos_token_id"), fields.general("tokenizer.ggml.eot_token_id")
    return dict(
        architecture=architecture,
        vocab_size=int(fields.get("vocab_size", len(tokens) if tokens else None)),
        hidden_size=int(fields.get("embedding_length")),
        intermediate_size=int(fields.get("feed_forward_length")),
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_theta=float(fields.get("rope.freq_base", 10000.0)),
        rope_scaling=None,
        rms_norm_eps=float(fields.get("attention.layer_norm_rms_epsilon", 1e-5)),  # llama.cpp's default
        max_position_embeddings=int(fields.get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in fields.tensor_names,
        attention_bias="blk.0.attn_q.bias" in fields.tensor_names,
        bos_token_id=fields.general("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(t for t in (eos, eot) if t is not None)),
    )
