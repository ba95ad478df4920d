"""Gemma 3 (text) and Gemma 2: local (sliding-window) and global layers in a ratio (`sliding_window_pattern`:
every n-th layer is global, the others local; Gemma 3 ships 6, i.e. 5 local : 1 global), each kind
with its own rope (global: rope_theta 1e6 and linear scaling on the larger models; local: 10,000),
q/k RMSNorm per head, scores scaled by query_pre_attn_scalar^-0.5, embeddings scaled by
sqrt(hidden), (1 + w) RMSNorm, four norms per block and GeGLU:

    h   = x + post_attention_layernorm(self_attn(input_layernorm(x)))
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

Loaded from config.json (Gemma3ForCausalLM, Gemma3TextConfig) and GGUF (`gemma3`: llama.cpp's
converter adds 1 to every norm weight, which the loader takes off again; NEOX rope, no Q/K
permutation; its local rope base and window pattern are llama.cpp's fixed 10,000 and 6 unless the
file says otherwise).

Local layers declare their window in their cache spec (SelfAttention): their layer group gives
back blocks that fall out of the window, and the kernels read only the window; global layers
keep the whole context. Attention-logit soft-capping (attn_logit_softcapping: scores s ->
c * tanh(s / c) after the scale) is every layer's, passed to the attention kernels.

Gemma 2 (Gemma2ForCausalLM, GGUF `gemma2`) is the same block without the q/k norms: its layers
alternate (pattern 2: even layers local, odd global), both kinds with the one rope base, and its
configs cap the attention logits (50) and the final logits (30). GEMMA_DEFAULTS holds what each
generation's files leave unsaid.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.model import llama
from kvserve.engine.model.config_fields import gguf_config_fields, hf_config_fields
from kvserve.engine.model.decoder_lm import DecoderLM
from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model.gguf_metadata import GGUFFields
from kvserve.engine.model.hf_config import rope_from_hf
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import ModelConfigError
from kvserve.engine.model.model_family import CheckpointLayout, GGUFTensor, ModelFamily
from kvserve.engine.model.protocol import Rope
from kvserve.engine.model.rms_norm import OffsetRMSNorm
from kvserve.engine.model.rope import RotaryEmbedding
from kvserve.engine.model.self_attention import SelfAttention
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel
from kvserve.kernels import AttentionMetadata, KVCache
from kvserve.paging.kv_sizing import ModelShape

LOCAL, GLOBAL = 0, 1  # the index of each layer kind's rope in the model's rope list
LLAMA_CPP_LOCAL_ROPE_THETA = 10000.0
LLAMA_CPP_WINDOW_PATTERN = 6


@dataclass(frozen=True)
class GemmaDefaults:
    """What a Gemma generation's config.json / GGUF leaves unsaid, as transformers and llama.cpp assume it."""

    window_pattern: int  # every n-th layer global (Gemma 2: 2, i.e. alternating)
    qk_norm: bool
    own_local_rope: bool  # local layers have their own rope base (Gemma 3) or the global one (Gemma 2)
    largest_model_layers: int  # llama.cpp: the model whose query_pre_attn_scalar is hidden / heads (27B)


GEMMA_DEFAULTS = {
    "gemma3": GemmaDefaults(window_pattern=LLAMA_CPP_WINDOW_PATTERN, qk_norm=True, own_local_rope=True,
                            largest_model_layers=62),
    "gemma2": GemmaDefaults(window_pattern=2, qk_norm=False, own_local_rope=False, largest_model_layers=46),
}


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    query_pre_attn_scalar: float = 256.0
    local_window: int = 4096  # the local layers' window (ModelConfig.sliding_window is every layer's: None)
    sliding_window_pattern: int = LLAMA_CPP_WINDOW_PATTERN  # every n-th layer is global
    local_rope_theta: float = LLAMA_CPP_LOCAL_ROPE_THETA
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # every layer's cap on its attention scores
    qk_norm: bool = True  # Gemma 3's q/k RMSNorm per head (Gemma 2 has none)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.query_pre_attn_scalar <= 0 or self.local_window < 1 or self.sliding_window_pattern < 1:
            raise ModelConfigError("query_pre_attn_scalar, sliding_window and sliding_window_pattern must be positive, "
                                   f"got {self.query_pre_attn_scalar}, {self.local_window}, {self.sliding_window_pattern}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise ModelConfigError(f"{name} must be positive (or absent), got {cap}")

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern == 0

    def kv_shape(self, name: str = "model") -> ModelShape:
        local = sum(not self.is_global(i) for i in range(self.num_layers))
        return dataclasses.replace(super().kv_shape(name), sliding_window=self.local_window if local else None,
                                   num_window_layers=local)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """gelu_pytorch_tanh, Gemma's hidden_activation (the gate of its GeGLU)."""
    return F.gelu(x, approximate="tanh")


class SandwichBlock(nn.Module):
    """Gemma's block: each sublayer's output is normalised again before the residual add."""

    def __init__(self, config: Gemma3Config, parallel: TensorParallel, layer: int) -> None:
        super().__init__()

        def norm(dim: int = config.hidden_size) -> OffsetRMSNorm:
            return OffsetRMSNorm(dim, config.rms_norm_eps)

        window = None if config.is_global(layer) else config.local_window
        self.input_layernorm = norm()
        self.self_attn = SelfAttention(config, parallel, scale=config.query_pre_attn_scalar**-0.5,
                                       qk_norm=norm if config.qk_norm else None, sliding_window=window,
                                       soft_cap=config.attn_logit_softcapping)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, parallel, activation=gelu_tanh)
        self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata, attention) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, attention))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def build(config: Gemma3Config, parallel: TensorParallel = SINGLE) -> DecoderLM:
    local_rope = RotaryEmbedding(replace(config, rope_theta=config.local_rope_theta, rope_scaling=None))
    return DecoderLM(config, [SandwichBlock(config, parallel, i) for i in range(config.num_layers)],
                     OffsetRMSNorm(config.hidden_size, config.rms_norm_eps), [local_rope, RotaryEmbedding(config)],
                     parallel, rope_of_layer=[GLOBAL if config.is_global(i) else LOCAL for i in range(config.num_layers)],
                     embed_scale=config.hidden_size**0.5, final_logit_soft_cap=config.final_logit_softcapping)


def _cap(value: Any) -> float | None:
    return float(value) if value else None  # 0 / null: no cap


def config_from_hf(architecture: str, hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> Gemma3Config:
    defaults = GEMMA_DEFAULTS[architecture]
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one rope per layer kind
        global_theta, global_scaling = rope_from_hf({"rope_parameters": params["full_attention"]})
        local_theta, _ = rope_from_hf({"rope_parameters": params.get("sliding_attention", {})})
    else:  # transformers 4: rope_theta / rope_scaling for the global layers, rope_local_base_freq for the local
        global_theta, global_scaling = rope_from_hf(hf)
        local_theta = float(hf.get("rope_local_base_freq", LLAMA_CPP_LOCAL_ROPE_THETA)) if defaults.own_local_rope else global_theta
    values = hf_config_fields(architecture, {"tie_word_embeddings": True, **hf}, generation)
    values.update(rope_theta=global_theta, rope_scaling=global_scaling)
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or defaults.window_pattern)
    if hf.get("layer_types") is not None:
        pattern = _pattern_of([kind == "sliding_attention" for kind in hf["layer_types"]], "config.json layer_types")
    window = int(hf.get("sliding_window") or 4096)
    return Gemma3Config(**values, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or values["head_dim"]),
                        local_window=window, sliding_window_pattern=pattern, local_rope_theta=local_theta,
                        final_logit_softcapping=_cap(hf.get("final_logit_softcapping")),
                        attn_logit_softcapping=_cap(hf.get("attn_logit_softcapping")), qk_norm=defaults.qk_norm)


def _pattern_of(is_local: list[bool], where: str) -> int:
    """n from a per-layer list in which every n-th layer (and only it) is global."""
    pattern = next((i + 1 for i, local in enumerate(is_local) if not local), len(is_local) + 1)
    if is_local != [(i + 1) % pattern != 0 for i in range(len(is_local))]:
        raise ModelConfigError(f"{where}: the layers are not every n-th one global, with the others local")
    return pattern


def config_from_gguf(architecture: str, fields: GGUFFields) -> Gemma3Config:
    defaults = GEMMA_DEFAULTS[architecture]
    values = gguf_config_fields(architecture, fields)
    scaling_type = fields.optional("rope.scaling.type")
    if scaling_type == "linear":
        values["rope_scaling"] = {"rope_type": "linear", "factor": float(fields.get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelConfigError(f"{fields.path}: GGUF rope scaling {scaling_type!r} is not supported for {architecture}")
    window = int(fields.get("attention.sliding_window"))
    pattern = fields.optional("attention.sliding_window_pattern")
    if isinstance(pattern, list | tuple):
        pattern = _pattern_of([bool(p) for p in pattern], f"{fields.path}: sliding_window_pattern")
    # llama.cpp's rule (the GGUF does not store query_pre_attn_scalar): hidden / heads for the
    # 27B model, head_dim for the others, as their config.json files say.
    largest = values["num_layers"] == defaults.largest_model_layers
    scalar = values["hidden_size"] / values["num_heads"] if largest else values["head_dim"]
    local_theta = LLAMA_CPP_LOCAL_ROPE_THETA if defaults.own_local_rope else values["rope_theta"]
    return Gemma3Config(**values, query_pre_attn_scalar=float(scalar), local_window=window,
                        sliding_window_pattern=int(pattern) if isinstance(pattern, int) else defaults.window_pattern,
                        local_rope_theta=local_theta, final_logit_softcapping=_cap(fields.optional("final_logit_softcapping")),
                        attn_logit_softcapping=_cap(fields.optional("attn_logit_softcapping")), qk_norm=defaults.qk_norm)


BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
               "self_attn.q_norm", "self_attn.k_norm")


def checkpoint_layout(config: Gemma3Config) -> CheckpointLayout:
    """Llama's projections (fused on load) with Gemma's six norms per block (four: Gemma 2)."""
    return llama.checkpoint_layout(config, BLOCK_NORMS if config.qk_norm else BLOCK_NORMS[:4])


GGUF_LAYER_NAMES = {
    **{k: v for k, v in llama.GGUF_LAYER_NAMES.items() if k != "ffn_norm.weight" and ".bias" not in k},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
NORM_SHIFT = 1.0  # llama.cpp's converter stores Gemma's norms as 1 + w


def gguf_tensor(config: Gemma3Config, name: str) -> GGUFTensor | None:
    if name in llama.GGUF_GLOBAL_NAMES:
        return GGUFTensor(llama.GGUF_GLOBAL_NAMES[name], shift=NORM_SHIFT if name == "output_norm.weight" else 0.0)
    block, rest = llama.gguf_place(name, GGUF_LAYER_NAMES, "Gemma")
    return GGUFTensor(f"model.layers.{block}.{GGUF_LAYER_NAMES[rest]}", shift=NORM_SHIFT if "norm" in rest else 0.0)


GEMMA3 = ModelFamily(
    name="gemma",
    architectures={"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"},
    gguf_architectures={"gemma3": "gemma3", "gemma2": "gemma2"},
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    checkpoint_layout=checkpoint_layout,
    gguf_tensor=gguf_tensor,
    build=build,
)
