"""Gemma 3 4B/12B/27B checkpoints (Gemma3ForConditionalGeneration): their text model, served as
Gemma 3 text (engine/model/gemma3.py); image inputs are refused by the server before they get here.

    config.json  {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {...},
                  "vision_config": {...}, "eos_token_id": [1, 106], ...}
    weights      model.language_model.*  (transformers 5; older saves: language_model.model.*),
                 lm_head tied, or language_model.lm_head.weight;
                 vision_tower.* and multi_modal_projector.* are never read

The shipped text_config names only what differs from transformers' Gemma3TextConfig defaults
(google/gemma-3-4b-it writes hidden_size, intermediate_size, num_hidden_layers, rope_scaling and
sliding_window): the rest is filled from those defaults, as transformers does. llama.cpp converts
these checkpoints to a text GGUF of the `gemma3` architecture (its vision tower goes to a separate
mmproj file), which engine/model/gemma3.py loads like 1B's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvserve.engine.model.gemma3 import GEMMA3
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import CorruptModelError
from kvserve.engine.model.model_family import CheckpointLayout, ModelFamily, WeightTarget

# transformers' Gemma3TextConfig defaults (rope_theta: its global layers' default theta).
TEXT_CONFIG_DEFAULTS: Mapping[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}
# Fields the multimodal config holds for the whole model, which the text model takes from it
# when its text_config does not say.
OUTER_FIELDS = ("bos_token_id", "eos_token_id", "tie_word_embeddings")

TEXT_PREFIX = "model.language_model."
# Older transformers' names -> newer ones (its Gemma3ForConditionalGeneration conversion mapping).
RENAMES: Mapping[str, str] = {
    "language_model.model.": TEXT_PREFIX,
    "language_model.lm_head.": "lm_head.",
    "vision_tower.": "model.vision_tower.",
    "multi_modal_projector.": "model.multi_modal_projector.",
}
NOT_LOADED = ("model.vision_tower.", "model.multi_modal_projector.")


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config.json fields, with transformers' defaults where they are absent."""
    text = hf.get("text_config") or {}
    if not isinstance(text, Mapping):
        raise CorruptModelError(f"config.json's text_config is not an object: {text!r}")
    outer = {k: hf[k] for k in OUTER_FIELDS if hf.get(k) is not None}
    # (transformers 5's rope_parameters, one rope per layer kind, carry their own thetas.)
    return {**TEXT_CONFIG_DEFAULTS, **outer, **text}


def config_from_hf(architecture: str, hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelConfig:
    config = GEMMA3.config_from_hf("gemma3", text_config(hf), generation)
    return replace(config, architecture=architecture)


def _prefixed(target: WeightTarget) -> WeightTarget:
    sources = tuple(TEXT_PREFIX + s.removeprefix("model.") if s.startswith("model.") else s for s in target.sources)
    return replace(target, sources=sources)


def checkpoint_layout(config: ModelConfig) -> CheckpointLayout:
    text = GEMMA3.checkpoint_layout(config)
    return replace(text, targets=tuple(_prefixed(t) for t in text.targets),
                   ignored_prefixes=(*text.ignored_prefixes, *NOT_LOADED), renames={**text.renames, **RENAMES})


HF_CLASS = "Gemma3ForConditionalGeneration"
GEMMA3_MULTIMODAL = ModelFamily(
    name="gemma3_multimodal",
    architectures={"gemma3_multimodal": HF_CLASS},
    gguf_architectures={},  # llama.cpp writes the text model as `gemma3` (engine/model/gemma3.py)
    config_from_hf=config_from_hf,
    config_from_gguf=GEMMA3.config_from_gguf,
    checkpoint_layout=checkpoint_layout,
    gguf_tensor=GEMMA3.gguf_tensor,
    build=GEMMA3.build,
)
