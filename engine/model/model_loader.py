"""`load_model`: a ModelSource -> (ModelConfig, LlamaForCausalLM) on the chosen device and dtype.

Both formats first become a state dict in transformers' names; `fuse_weights` then maps it onto
our module (fused qkv_proj and gate_up_proj) and checks that every weight is present and shaped
right, so a damaged or mismatched checkpoint fails with its tensor named.
"""

from __future__ import annotations

import re

import torch

from kvserve.engine.model.gguf_loader import load_gguf_weights
from kvserve.engine.model.gguf_metadata import model_config_from_gguf, read_gguf
from kvserve.engine.model.hf_loader import load_hf_weights
from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig, load_model_config
from kvserve.engine.model.model_errors import CorruptModelError
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model.rope import RotaryEmbedding

LAYER_PREFIX = re.compile(r"model\.layers\.(\d+)\.")


def _take(weights: dict[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    if name not in weights:
        raise CorruptModelError(f"{where}: weight {name!r} is missing from the checkpoint")
    return weights.pop(name)


def fuse_weights(weights: dict[str, torch.Tensor], config: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """HF names -> LlamaForCausalLM names. Consumes `weights` to keep peak memory at one copy."""
    fused = {
        "embed_tokens.weight": _take(weights, "model.embed_tokens.weight", where),
        "norm.weight": _take(weights, "model.norm.weight", where),
    }
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints store a copy anyway
    else:
        fused["lm_head.weight"] = _take(weights, "lm_head.weight", where)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for same in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                     "mlp.down_proj.weight"):
            fused[dst + same] = _take(weights, src + same, where)
        fused[dst + "self_attn.qkv_proj.weight"] = torch.cat(
            [_take(weights, f"{src}self_attn.{p}_proj.weight", where) for p in "qkv"])
        if config.attention_bias:
            fused[dst + "self_attn.qkv_proj.bias"] = torch.cat(
                [_take(weights, f"{src}self_attn.{p}_proj.bias", where) for p in "qkv"])
        fused[dst + "mlp.gate_up_proj.weight"] = torch.cat(
            [_take(weights, f"{src}mlp.{p}_proj.weight", where) for p in ("gate", "up")])
    if weights:
        names = sorted(weights)
        raise CorruptModelError(f"{where}: unexpected weights {names[:5]}{' ...' if len(names) > 5 else ''}; "
                                "the checkpoint does not match its config")
    return fused


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                where: str, rope_freq_factors: torch.Tensor | None = None) -> LlamaForCausalLM:
    """Assemble the module on the meta device and adopt the loaded tensors (no double allocation)."""
    state = fuse_weights(weights, config, where)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise CorruptModelError(f"{where}: weight {name!r} has shape {tuple(state[name].shape)}, "
                                    f"the config implies {tuple(shape)}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary_emb = RotaryEmbedding(config, rope_freq_factors).to(device)
    return model.eval().requires_grad_(False)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> tuple[ModelConfig, LlamaForCausalLM]:
    device = torch.device(device)
    if source.format == "gguf":
        reader = read_gguf(source.path)
        config = model_config_from_gguf(reader, source.path)
        weights, rope_factors = load_gguf_weights(reader, config, source.path, dtype, device)
        return config, build_model(config, weights, device, str(source.path), rope_factors)
    config = load_model_config(source.path)
    weights = load_hf_weights(source.path, dtype, device)
    return config, build_model(config, weights, device, str(source.path))
