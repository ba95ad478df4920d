"""The Llama family (Llama, Mistral, Qwen2): its forward over a flattened batch of many requests,
its config parsing (config.json, GGUF metadata) and its checkpoint layout, registered as one
ModelFamily (engine/model/registry.py).

Each block reads like the math:  h = x + Attention(RMSNorm(x));  out = h + MLP(RMSNorm(h)).
Attention writes this step's K/V into the paged cache and reads the whole context back through
the block tables; which kernel does it is the caller's choice (`attention`), so the forward is
the same on CPU and GPU. Q/K/V and gate/up are fused into one matmul each: fewer, larger GEMMs,
which is what both AMX on CPU and tensor cores want for small batches. Under tensor parallelism
the model is built with one rank's heads and MLP columns (engine/model/parallel_layers.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvserve.engine.model.decoder_stack import run_decoder
from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model.gguf_metadata import GGUFFields
from kvserve.engine.model.hf_config import eos_token_ids, rope_from_hf, shape_from_hf_dict
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import ModelConfigError
from kvserve.engine.model.model_family import CheckpointLayout, GGUFTensor, ModelFamily, Split, WeightTarget
from kvserve.engine.model.parallel_layers import column_parallel_linear, lm_head, row_parallel_linear, vocab_embedding
from kvserve.engine.model.protocol import Rope
from kvserve.engine.model.rms_norm import RMSNorm
from kvserve.engine.model.rope import RotaryEmbedding, apply_rotary
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel
from kvserve.kernels import AttentionMetadata, KVCache
from kvserve.paging import FullAttentionSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from kvserve.kernels import AttentionBackend

class Attention(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = parallel.local(config.num_heads), parallel.local(config.num_kv_heads)
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = column_parallel_linear(config.hidden_size, (config.q_size, config.kv_size, config.kv_size),
                                               config.attention_bias, parallel)
        self.o_proj = row_parallel_linear(config.q_size, config.hidden_size, parallel)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        attention.write_kv_cache(k, v, kv_cache, meta)
        out = attention.paged_attention(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, parallel)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, parallel)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, parallel) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, parallel,
                               tied_to=self.embed_tokens if config.tie_word_embeddings else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: list[AttentionMetadata], attention: AttentionBackend) -> torch.Tensor:
        return run_decoder(self, input_ids, positions, kv_caches, attn_metadata, attention)

    def kv_cache_specs(self, dtype: str, dtype_bytes: int) -> list[FullAttentionSpec]:
        """What each layer keeps in the KV cache (the runner groups and sizes the cache from it):
        with Mistral's sliding window, a window spec, whose blocks leave the cache as the window
        moves on (the kernels read only the window: the step metadata carries it)."""
        # From the layers themselves: a tensor-parallel rank's layers hold its share of the heads.
        window = self.config.sliding_window
        return [FullAttentionSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, dtype, dtype_bytes)
                if window is None else
                SlidingWindowSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, dtype, dtype_bytes,
                                  sliding_window=window)
                for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (the rows to sample from) -> logits [N, vocab] in the model's dtype.
        No float32 copy here: a greedy batch needs only an argmax, which upcasting cannot change,
        and the sampler upcasts the batches that need more (64 bf16 rows: 6 MB read, 12 MB
        written per step otherwise)."""
        return self.lm_head(hidden)


# ---------------------------------------------------------------------------- config parsing


def config_from_hf(architecture: str, hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelConfig:
    if architecture == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ModelConfigError("Llama checkpoints with attention_bias/mlp_bias (o_proj/MLP biases) are not supported")
    shape = shape_from_hf_dict("config.json", hf)
    max_pos = int(hf.get("max_position_embeddings", 4096))
    sliding_window = hf.get("sliding_window")
    window = None
    if architecture == "mistral" and sliding_window:
        # Served with the window: every layer attends to the last `sliding_window` positions
        # (Mistral 7B v0.1), and its cache holds only those.
        window = int(sliding_window)
    elif architecture == "qwen2" and sliding_window and hf.get("use_sliding_window", False):
        # Qwen2 windows only the layers from max_window_layers on; not served: full attention is
        # identical within the window, so we serve only that much context rather than silently
        # computing something else.
        max_pos = min(max_pos, int(sliding_window))
    theta, scaling = rope_from_hf(hf)
    if scaling is not None and scaling["rope_type"] == "yarn":
        # rope.py computes YaRN as transformers does, but it is verified only for DeepSeek here.
        raise ModelConfigError("rope scaling 'yarn' is not supported for Llama-family models")
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
        eos_token_ids=eos_token_ids(hf, generation),
        sliding_window=window,
    )


ROPE_FREQS = "rope_freqs.weight"


def config_from_gguf(architecture: str, fields: GGUFFields) -> ModelConfig:
    shape = fields.shape()
    tokens = fields.general("tokenizer.ggml.tokens")
    vocab_size = int(fields.get("vocab_size", len(tokens) if tokens else None))
    eos, eot = fields.general("tokenizer.ggml.eos_token_id"), fields.general("tokenizer.ggml.eot_token_id")
    scaling_type = fields.optional("rope.scaling.type")
    rope_scaling = None
    if scaling_type in ("linear", "dynamic"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(fields.get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelConfigError(f"{fields.path}: GGUF rope scaling {scaling_type!r} is not supported")
    # Llama 3.1 GGUFs carry their llama3 rope scaling as a `rope_freqs.weight` tensor instead of metadata.
    freq_factors = fields.small_tensor(ROPE_FREQS)
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=int(fields.get("embedding_length")),
        intermediate_size=int(fields.get("feed_forward_length")),
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_theta=float(fields.get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(fields.get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(fields.get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in fields.tensor_names,
        attention_bias="blk.0.attn_q.bias" in fields.tensor_names,
        bos_token_id=fields.general("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(t for t in (eos, eot) if t is not None)),
        rope_freq_factors=None if freq_factors is None else tuple(float(f) for f in freq_factors),
    )


# ---------------------------------------------------------------------------- checkpoint layout


def checkpoint_layout(config: ModelConfig) -> CheckpointLayout:
    """Our fused modules (qkv_proj, gate_up_proj) from transformers' separate projections."""
    targets = [WeightTarget("embed_tokens.weight", ("model.embed_tokens.weight",), Split.VOCAB),
               WeightTarget("norm.weight", ("model.norm.weight",))]
    if not config.tie_word_embeddings:
        targets.append(WeightTarget("lm_head.weight", ("lm_head.weight",), Split.VOCAB))
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        targets += [
            WeightTarget(dst + "input_layernorm.weight", (src + "input_layernorm.weight",)),
            WeightTarget(dst + "post_attention_layernorm.weight", (src + "post_attention_layernorm.weight",)),
            WeightTarget(dst + "self_attn.qkv_proj.weight",
                         tuple(f"{src}self_attn.{p}_proj.weight" for p in "qkv"), Split.COLUMN),
            WeightTarget(dst + "self_attn.o_proj.weight", (src + "self_attn.o_proj.weight",), Split.ROW),
            WeightTarget(dst + "mlp.gate_up_proj.weight",
                         (src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"), Split.COLUMN),
            WeightTarget(dst + "mlp.down_proj.weight", (src + "mlp.down_proj.weight",), Split.ROW),
        ]
        if config.attention_bias:
            targets.append(WeightTarget(dst + "self_attn.qkv_proj.bias",
                                        tuple(f"{src}self_attn.{p}_proj.bias" for p in "qkv"), Split.COLUMN))
    # Some tied checkpoints store a copy of the embedding as lm_head anyway.
    return CheckpointLayout(tuple(targets), frozenset({"lm_head.weight"}) if config.tie_word_embeddings else frozenset())


GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# llama.cpp's converter permutes the rows of Q and K for its interleaved rope in the "llama"
# architecture (Mistral included); the loader inverts it, so one rotate-half rope serves both
# formats. Qwen2 uses llama.cpp's NEOX rope, which is rotate-half already: no permutation.
ROPE_PERMUTED = ("attn_q.weight", "attn_k.weight")


def gguf_tensor(config: ModelConfig, name: str) -> GGUFTensor | None:
    if name == ROPE_FREQS:
        return None  # read into the config (rope_freq_factors)
    if name in GGUF_GLOBAL_NAMES:
        return GGUFTensor(GGUF_GLOBAL_NAMES[name])
    block, _, rest = name.partition(".")[2].partition(".")
    if not name.startswith("blk.") or not block.isdigit() or rest not in GGUF_LAYER_NAMES:
        raise ModelConfigError(f"GGUF tensor {name!r} has no place in a dense Llama-family model "
                               "(mixture-of-experts and multimodal GGUFs are not supported)")
    permuted = config.architecture in ("llama", "mistral") and rest in ROPE_PERMUTED
    return GGUFTensor(f"model.layers.{block}.{GGUF_LAYER_NAMES[rest]}", config.head_dim if permuted else None)


LLAMA = ModelFamily(
    name="llama",
    architectures={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"},
    gguf_architectures={"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"},
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    checkpoint_layout=checkpoint_layout,
    gguf_tensor=gguf_tensor,
    build=LlamaForCausalLM,
)
