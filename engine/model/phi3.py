"""Phi-3 and Phi-4-mini: Llama's block with q, k, v fused in one checkpoint tensor (qkv_proj) and
gate/up in another (gate_up_proj: gate rows first), partial rotary (partial_rotary_factor: the
leading dims of each head rotate), LongRoPE scaling (per-frequency short/long factors and an
attention factor on cos/sin) and an optional sliding window on every layer. Loaded from
config.json (Phi3ForCausalLM) and GGUF (`phi3`: attn_qkv / ffn_up fused as in the checkpoint,
NEOX rope, the factors in rope_factors_long / rope_factors_short)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.engine.model import llama
from kvserve.engine.model.config_fields import gguf_config_fields, hf_config_fields, refuse_yarn
from kvserve.engine.model.decoder_lm import DecoderLM, PreNormBlock
from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model.gguf_metadata import GGUFFields
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import CorruptModelError, ModelConfigError
from kvserve.engine.model.model_family import CheckpointLayout, GGUFTensor, ModelFamily, Split, WeightTarget
from kvserve.engine.model.rms_norm import RMSNorm
from kvserve.engine.model.rope import RotaryEmbedding
from kvserve.engine.model.self_attention import SelfAttention
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class Phi3Config(ModelConfig):
    rotary_dim: int = 0  # the leading dims of each head that rotate (head_dim * partial_rotary_factor)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ModelConfigError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")


def build(config: Phi3Config, parallel: TensorParallel = SINGLE) -> DecoderLM:
    layers = [PreNormBlock(SelfAttention(config, parallel, sliding_window=config.sliding_window),
                           GatedMLP(config.hidden_size, config.intermediate_size, parallel),
                           RMSNorm(config.hidden_size, config.rms_norm_eps), RMSNorm(config.hidden_size, config.rms_norm_eps))
              for _ in range(config.num_layers)]
    return DecoderLM(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps),
                     [RotaryEmbedding(config, config.rotary_dim)], parallel)


def _window(values: dict[str, Any], window: int | None) -> int | None:
    """Every layer's window (Phi-3-mini's 2047), or None: a window that covers the whole context
    is no window (Phi-4-mini's 262144)."""
    return int(window) if window and window < values["max_position_embeddings"] else None


def config_from_hf(architecture: str, hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> Phi3Config:
    values = hf_config_fields(architecture, hf, generation)
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    scaling = values["rope_scaling"]
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
        if scaling["rope_type"] == "su":  # the name LongRoPE shipped under in the first Phi-3 configs
            scaling["rope_type"] = "longrope"
        if scaling["rope_type"] == "longrope":
            scaling.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        values["rope_scaling"] = scaling
    refuse_yarn(values, "Phi-3")
    rotary_dim = int(values["head_dim"] * float(factor))
    values["max_position_embeddings"] = int(hf.get("max_position_embeddings", 4096))
    window = _window(values, hf.get("sliding_window"))
    return Phi3Config(**values, rotary_dim=rotary_dim, sliding_window=window)


def config_from_gguf(architecture: str, fields: GGUFFields) -> Phi3Config:
    values = gguf_config_fields(architecture, fields)
    rotary_dim = int(fields.get("rope.dimension_count", values["head_dim"]))
    long, short = fields.small_tensor("rope_factors_long.weight"), fields.small_tensor("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise CorruptModelError(f"{fields.path}: a LongRoPE GGUF needs both rope_factors_long and rope_factors_short")
    if long is not None:
        values["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": tuple(float(f) for f in long),
            "short_factor": tuple(float(f) for f in short),
            "original_max_position_embeddings": int(fields.get("rope.scaling.original_context_length")),
            "attention_factor": float(fields.get("rope.scaling.attn_factor", 1.0)),
        }
    window = _window(values, fields.optional("attention.sliding_window"))
    return Phi3Config(**values, rotary_dim=rotary_dim, sliding_window=window)


def checkpoint_layout(config: Phi3Config) -> CheckpointLayout:
    """Fused in the checkpoint as in our modules; a column split cuts q, k, v (gate, up) apart."""
    targets = llama.embedding_targets(config)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        targets += [
            WeightTarget(dst + "self_attn.qkv_proj.weight", (src + "self_attn.qkv_proj.weight",), Split.COLUMN,
                         (config.q_size, config.kv_size, config.kv_size)),
            WeightTarget(dst + "mlp.gate_up_proj.weight", (src + "mlp.gate_up_proj.weight",), Split.COLUMN,
                         (config.intermediate_size,) * 2),
            *llama.block_targets(src, dst),
        ]
    return CheckpointLayout(tuple(targets), llama.tied_copies(config))


GGUF_LAYER_NAMES = {
    **{k: v for k, v in llama.GGUF_LAYER_NAMES.items() if k in ("attn_norm.weight", "ffn_norm.weight",
                                                                 "attn_output.weight", "ffn_down.weight")},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate and up, fused as in the checkpoint
}
GGUF_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def gguf_tensor(config: Phi3Config, name: str) -> GGUFTensor | None:
    if name in GGUF_CONFIG_TENSORS:
        return None  # read into the config
    if name in llama.GGUF_GLOBAL_NAMES:
        return GGUFTensor(llama.GGUF_GLOBAL_NAMES[name])
    block, rest = llama.gguf_place(name, GGUF_LAYER_NAMES, "Phi-3 (fused attn_qkv)")
    return GGUFTensor(f"model.layers.{block}.{GGUF_LAYER_NAMES[rest]}")


PHI3 = ModelFamily(
    name="phi3",
    architectures={"phi3": "Phi3ForCausalLM"},
    gguf_architectures={"phi3": "phi3"},
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    checkpoint_layout=checkpoint_layout,
    gguf_tensor=gguf_tensor,
    build=build,
)
