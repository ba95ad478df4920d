"""Qwen3 (dense): Llama's block with RMSNorm on q and k per head (over head_dim, before rope),
no qkv bias by default, head_dim given by the config rather than hidden / heads. Loaded from
config.json (Qwen3ForCausalLM) and from GGUF (`qwen3`: llama.cpp's NEOX rope, so Q and K are not
permuted; attn_q_norm / attn_k_norm carry the per-head norms)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.engine.model import llama
from kvserve.engine.model.config_fields import gguf_config_fields, hf_config_fields, refuse_yarn
from kvserve.engine.model.decoder_lm import DecoderLM, PreNormBlock
from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model.gguf_metadata import GGUFFields
from kvserve.engine.model.hf_config import qwen_window_layers
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import ModelConfigError
from kvserve.engine.model.model_family import CheckpointLayout, GGUFTensor, ModelFamily, WeightTarget
from kvserve.engine.model.rms_norm import RMSNorm
from kvserve.engine.model.rope import RotaryEmbedding
from kvserve.engine.model.self_attention import SelfAttention
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel


def build(config: ModelConfig, parallel: TensorParallel = SINGLE) -> DecoderLM:
    def norm(dim: int) -> RMSNorm:
        return RMSNorm(dim, config.rms_norm_eps)

    layers = [PreNormBlock(SelfAttention(config, parallel, qk_norm=norm, sliding_window=config.layer_window(i)),
                           GatedMLP(config.hidden_size, config.intermediate_size, parallel),
                           norm(config.hidden_size), norm(config.hidden_size))
              for i in range(config.num_layers)]
    return DecoderLM(config, layers, norm(config.hidden_size), [RotaryEmbedding(config)], parallel)


QWEN3_DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config default, when config.json leaves it out


def config_from_hf(architecture: str, hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelConfig:
    hf = {**hf, "head_dim": hf.get("head_dim") or QWEN3_DEFAULT_HEAD_DIM}
    fields = hf_config_fields(architecture, hf, generation)
    refuse_yarn(fields, "Qwen3")
    # With use_sliding_window, the layers from max_window_layers on attend within the window.
    fields["sliding_window"], fields["window_layers"] = qwen_window_layers(hf, fields["num_layers"])
    return ModelConfig(**fields)


def config_from_gguf(architecture: str, fields: GGUFFields) -> ModelConfig:
    values = gguf_config_fields(architecture, fields)
    if fields.optional("rope.scaling.type") not in (None, "none"):
        raise ModelConfigError(f"{fields.path}: GGUF rope scaling {fields.optional('rope.scaling.type')!r} is "
                               "not supported for qwen3")
    return ModelConfig(**values)


def checkpoint_layout(config: ModelConfig) -> CheckpointLayout:
    """Llama's layout (fused qkv and gate_up from the separate projections) plus the q/k norms."""
    layout = llama.checkpoint_layout(config)
    norms = tuple(WeightTarget(f"layers.{i}.self_attn.{n}.weight", (f"model.layers.{i}.self_attn.{n}.weight",))
                  for i in range(config.num_layers) for n in ("q_norm", "k_norm"))
    return CheckpointLayout(layout.targets + norms, layout.ignored)


GGUF_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}


def gguf_tensor(config: ModelConfig, name: str) -> GGUFTensor | None:
    found = llama.gguf_block_tensor(name)
    if found is not None and found[1] in GGUF_NORMS:
        return GGUFTensor(f"model.layers.{found[0]}.{GGUF_NORMS[found[1]]}")
    return llama.gguf_tensor(config, name)  # no Q/K permutation: only "llama"/"mistral" have one


QWEN3 = ModelFamily(
    name="qwen3",
    architectures={"qwen3": "Qwen3ForCausalLM"},
    gguf_architectures={"qwen3": "qwen3"},
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    checkpoint_layout=checkpoint_layout,
    gguf_tensor=gguf_tensor,
    build=build,
)
