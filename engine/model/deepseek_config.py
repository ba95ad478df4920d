"""The DeepSeek-V2/V3 family's config: multi-head latent attention and mixture-of-experts fields
on top of the shared ModelConfig, read from config.json or from llama.cpp's `deepseek2` GGUF
metadata.

ModelConfig's head_dim is the rope's width (qk_rope_head_dim, as transformers sets it), so the
shared rotary embedding rotates the decoupled rope key; num_kv_heads equals num_heads (K/V are
decompressed per head), although the cache keeps one latent per token (kv_shape).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.engine.model.gguf_metadata import GGUFFields
from kvserve.engine.model.config_fields import common_hf_fields
from kvserve.engine.model.hf_config import rope_from_hf
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import ModelConfigError
from kvserve.paging.kv_sizing import ModelShape

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class DeepseekConfig(ModelConfig):
    q_lora_rank: int | None = None  # None: a plain q projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True  # rope pairs are adjacent (x0, x1), (x2, x3) ... as DeepSeek trained
    first_k_dense_replace: int = 0  # layers [0, k) have a dense MLP, the rest MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    scoring_func: str = "softmax"  # V2 softmax, V3 sigmoid
    topk_method: str = "greedy"  # V3: noaux_tc (grouped top-k on scores + correction bias)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim != self.qk_rope_head_dim:
            raise ModelConfigError(f"head_dim ({self.head_dim}) must be qk_rope_head_dim ({self.qk_rope_head_dim})")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ModelConfigError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.scoring_func not in SCORING or self.topk_method not in TOPK_METHODS:
            raise ModelConfigError(f"MoE routing {self.scoring_func!r}/{self.topk_method!r} is not supported; "
                                   f"supported: scoring {', '.join(SCORING)}, top-k {', '.join(TOPK_METHODS)}")
        if self.first_k_dense_replace < self.num_layers and self.n_routed_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts or self.moe_intermediate_size < 1:
                raise ModelConfigError(f"MoE layers need 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                                       f"n_routed_experts ({self.n_routed_experts}) and a moe_intermediate_size")
            if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ModelConfigError(f"{self.n_routed_experts} experts do not split into {self.n_group} groups "
                                       f"with {self.topk_group} chosen")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is
        scaled (DeepSeek's long-context attention temperature)."""
        scale = self.qk_head_dim**-0.5
        scaling = self.rope_scaling or {}
        m_all, factor = scaling.get("mscale_all_dim"), float(scaling.get("factor", 1.0))
        if scaling.get("rope_type") == "yarn" and m_all and factor > 1:
            mscale = 0.1 * float(m_all) * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace and self.n_routed_experts > 0

    def kv_shape(self, name: str = "model") -> ModelShape:
        return ModelShape(name, self.num_layers, self.num_heads, self.num_heads, self.qk_head_dim,
                          self.max_position_embeddings, kv_lora_rank=self.kv_lora_rank,
                          qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)


def config_from_hf(architecture: str, hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> DeepseekConfig:
    if int(hf.get("moe_layer_freq", 1)) != 1:
        raise ModelConfigError(f"moe_layer_freq {hf['moe_layer_freq']} is not supported (every layer from "
                               "first_k_dense_replace on is MoE)")
    theta, scaling = rope_from_hf(hf)
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    v3 = architecture == "deepseek_v3"
    heads, layers = int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    return DeepseekConfig(
        architecture=architecture,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=int(hf.get("qk_rope_head_dim", 64)),
        rope_theta=theta,
        rope_scaling=scaling,
        **common_hf_fields(hf, generation),
        q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
        kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)),
        v_head_dim=int(hf.get("v_head_dim", 128)),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        first_k_dense_replace=int(hf.get("first_k_dense_replace", 0)),
        n_routed_experts=int(hf.get("n_routed_experts") or 0),
        n_shared_experts=int(hf.get("n_shared_experts") or 0),
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
        # transformers' DeepseekV3 always routes by sigmoid with the correction bias.
        scoring_func=hf.get("scoring_func", "sigmoid" if v3 else "softmax"),
        topk_method=hf.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid.
GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def config_from_gguf(architecture: str, fields: GGUFFields) -> DeepseekConfig:
    """llama.cpp's `deepseek2` metadata (V2, V2-Lite, V3 and R1 all convert to it)."""
    tokens = fields.general("tokenizer.ggml.tokens")
    heads = int(fields.get("attention.head_count"))
    rope_dim = int(fields.get("rope.dimension_count"))
    # Newer converters split kv_b and write the MLA sizes under *_mla (key_length is then the latent's).
    key_length = int(fields.optional("attention.key_length_mla") or fields.get("attention.key_length"))
    value_length = int(fields.optional("attention.value_length_mla") or fields.get("attention.value_length"))
    scaling = None
    if fields.optional("rope.scaling.type") == "yarn":
        factor = float(fields.get("rope.scaling.factor"))
        multiplier = fields.optional("rope.scaling.yarn_log_multiplier")  # 0.1 * mscale_all_dim
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": int(fields.get("rope.scaling.original_context_length")),
                   "beta_fast": 32, "beta_slow": 1}
        if multiplier:
            scaling |= {"mscale": float(multiplier) / 0.1, "mscale_all_dim": float(multiplier) / 0.1}
    elif fields.optional("rope.scaling.type") not in (None, "none"):
        raise ModelConfigError(f"{fields.path}: GGUF rope scaling {fields.optional('rope.scaling.type')!r} is not supported")
    gating = int(fields.optional("expert_gating_func") or 1)
    eos, eot = fields.general("tokenizer.ggml.eos_token_id"), fields.general("tokenizer.ggml.eot_token_id")
    groups = int(fields.optional("expert_group_count") or 1)
    return DeepseekConfig(
        architecture=architecture,
        vocab_size=int(fields.get("vocab_size", len(tokens) if tokens else None)),
        hidden_size=int(fields.get("embedding_length")),
        intermediate_size=int(fields.get("feed_forward_length")),
        num_layers=int(fields.get("block_count")),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=rope_dim,
        rope_theta=float(fields.get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(fields.get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(fields.get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in fields.tensor_names,
        attention_bias=False,
        bos_token_id=fields.general("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(t for t in (eos, eot) if t is not None)),
        q_lora_rank=int(fields.optional("attention.q_lora_rank") or 0) or None,
        kv_lora_rank=int(fields.get("attention.kv_lora_rank")),
        qk_nope_head_dim=key_length - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=value_length,
        rope_interleave=True,
        first_k_dense_replace=int(fields.optional("leading_dense_block_count") or 0),
        n_routed_experts=int(fields.optional("expert_count") or 0),
        n_shared_experts=int(fields.optional("expert_shared_count") or 0),
        num_experts_per_tok=int(fields.optional("expert_used_count") or 0),
        moe_intermediate_size=int(fields.optional("expert_feed_forward_length") or 0),
        scoring_func=GGUF_GATING.get(gating, f"gating {gating}"),
        topk_method="noaux_tc" if gating == 2 else ("group_limited_greedy" if groups > 1 else "greedy"),
        n_group=groups,
        topk_group=int(fields.optional("expert_group_used_count") or 1),
        norm_topk_prob=bool(fields.optional("expert_weights_norm") or False),
        routed_scaling_factor=float(fields.optional("expert_weights_scale") or 1.0),
    )
