"""The DeepSeek-V2/V3 family (DeepSeek-V2, V2-Lite, V2.5, V3, R1 and their GGUFs as llama.cpp's
`deepseek2`): latent attention (engine/model/mla_attention.py) and, from first_k_dense_replace
on, mixture-of-experts MLPs (engine/model/moe.py), registered as one ModelFamily.

    h = x + MLA(RMSNorm(x));  out = h + (MoE or dense MLP)(RMSNorm(h))

Every layer keeps one latent per token in the cache (MLAAttentionSpec); a single rank only
(tensor parallelism would split the heads of kv_b_proj and the experts: not built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.engine.model import llama
from kvserve.engine.model.deepseek_config import DeepseekConfig, config_from_gguf, config_from_hf
from kvserve.engine.model.decoder_stack import run_decoder
from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model.mla_attention import MLAAttention
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import ModelConfigError
from kvserve.engine.model.model_family import CheckpointLayout, GGUFTensor, ModelFamily, Split, WeightTarget
from kvserve.engine.model.moe import MoE
from kvserve.engine.model.packed_linear import PackedLinear
from kvserve.engine.model.protocol import Rope
from kvserve.engine.model.rms_norm import RMSNorm
from kvserve.engine.model.rope import RotaryEmbedding
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel
from kvserve.kernels import AttentionMetadata, KVCache
from kvserve.paging import MLAAttentionSpec

if TYPE_CHECKING:
    from kvserve.kernels import AttentionBackend


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: DeepseekConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe_layer(index) else GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekForCausalLM(nn.Module):
    # Not through the compiled forward (engine/compilation.py), which runs every layer through
    # one graph: dense and MoE layers differ, and MoE routing has data-dependent shapes.
    compiles = False

    def __init__(self, config: ModelConfig, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        if not isinstance(config, DeepseekConfig):
            raise TypeError(f"DeepseekForCausalLM needs a DeepseekConfig, got {type(config).__name__}")
        if parallel.is_sharded:
            raise ModelConfigError("DeepSeek models run on one rank here: tensor parallelism is not supported for them")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: list[AttentionMetadata], attention: AttentionBackend) -> torch.Tensor:
        return run_decoder(self, input_ids, positions, kv_caches, attn_metadata, attention)

    def kv_cache_specs(self, dtype: str, dtype_bytes: int) -> list[MLAAttentionSpec]:
        """One latent per token in every layer: kv_lora_rank + qk_rope_head_dim values."""
        return [MLAAttentionSpec(layer.self_attn.kv_lora_rank, layer.self_attn.rope_dim, dtype, dtype_bytes)
                for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits(hidden)'s argmax per row where the lm_head gives it without the logits."""
        return self.lm_head.greedy_tokens(hidden) if isinstance(self.lm_head, PackedLinear) else None


# ---------------------------------------------------------------------------- checkpoint layout


def _mlp_targets(dst: str, src: str) -> list[WeightTarget]:
    return [WeightTarget(dst + "gate_up_proj.weight", (src + "gate_proj.weight", src + "up_proj.weight"), Split.COLUMN),
            WeightTarget(dst + "down_proj.weight", (src + "down_proj.weight",), Split.ROW)]


def checkpoint_layout(config: ModelConfig) -> CheckpointLayout:
    assert isinstance(config, DeepseekConfig)
    targets = [WeightTarget("embed_tokens.weight", ("model.embed_tokens.weight",)),
               WeightTarget("norm.weight", ("model.norm.weight",))]
    if not config.tie_word_embeddings:
        targets.append(WeightTarget("lm_head.weight", ("lm_head.weight",)))
    attention = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    attention += (["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"] if config.q_lora_rank is not None
                  else ["q_proj.weight"])
    if config.attention_bias:
        attention += ["kv_a_proj_with_mqa.bias", "o_proj.bias"] + (["q_a_proj.bias"] if config.q_lora_rank else [])
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        targets += [WeightTarget(dst + name, (src + name,)) for name in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        targets += [WeightTarget(f"{dst}self_attn.{name}", (f"{src}self_attn.{name}",)) for name in attention]
        if not config.is_moe_layer(i):
            targets += _mlp_targets(dst + "mlp.", src + "mlp.")
            continue
        targets.append(WeightTarget(dst + "mlp.gate.weight", (src + "mlp.gate.weight",)))
        if config.topk_method == "noaux_tc":
            targets.append(WeightTarget(dst + "mlp.gate.e_score_correction_bias", (src + "mlp.gate.e_score_correction_bias",)))
        for e in range(config.n_routed_experts):
            targets += _mlp_targets(f"{dst}mlp.experts.{e}.", f"{src}mlp.experts.{e}.")
        if config.n_shared_experts:
            targets += _mlp_targets(dst + "mlp.shared_experts.", src + "mlp.shared_experts.")
    # V3 checkpoints carry the multi-token-prediction module as extra layers past num_hidden_layers
    # (for speculative decoding, unused here); tied checkpoints may store lm_head anyway.
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    return CheckpointLayout(tuple(targets), frozenset(ignored), ignored_prefixes=(f"model.layers.{config.num_layers}.",))


# llama.cpp's `deepseek2` tensor names (convert_hf_to_gguf.py's DeepseekV2Model) -> transformers'.
GGUF_GLOBAL_NAMES = llama.GGUF_GLOBAL_NAMES  # embedding, final norm and lm_head: named as for every family
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
# Stacked [experts, out, in] in one GGUF tensor: expert e's slice is transformers' experts.{e}.
GGUF_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
}


def gguf_tensor(config: ModelConfig, name: str) -> GGUFTensor | None:
    if name in GGUF_GLOBAL_NAMES:
        return GGUFTensor(GGUF_GLOBAL_NAMES[name])
    block, _, rest = name.partition(".")[2].partition(".")
    if name.startswith("blk.") and block.isdigit():
        if rest in GGUF_LAYER_NAMES:
            return GGUFTensor(f"model.layers.{block}.{GGUF_LAYER_NAMES[rest]}")
        if rest in GGUF_EXPERT_NAMES:
            return GGUFTensor(f"model.layers.{block}.{GGUF_EXPERT_NAMES[rest]}", stacked_experts=True)
        if rest in ("attn_k_b.weight", "attn_v_b.weight"):
            return GGUFTensor(f"model.layers.{block}.self_attn.kv_b_proj.weight", kv_b_part=rest[5])
    raise ModelConfigError(f"GGUF tensor {name!r} has no place in a DeepSeek-V2/V3 model")


DEEPSEEK = ModelFamily(
    name="deepseek",
    architectures={"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"},
    gguf_architectures={"deepseek2": "deepseek_v2"},
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    checkpoint_layout=checkpoint_layout,
    gguf_tensor=gguf_tensor,
    build=DeepseekForCausalLM,
)
