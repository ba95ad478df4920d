"""The Llama family (Llama, Mistral, Qwen2): its forward over a flattened batch of many requests,
its config parsing (config.json, GGUF metadata) and its checkpoint layout, registered as one
ModelFamily (engine/model/registry.py).

Each block reads like the math:  h = x + Attention(RMSNorm(x));  out = h + MLP(RMSNorm(h))
(engine/model/decoder_lm.py's PreNormBlock; the model is its DecoderLM with one rope).
Attention writes this step's K/V into the paged cache and reads the whole context back through
the block tables; which kernel does it is the caller's choice (`attention`), so the forward is
the same on CPU and GPU. Q/K/V and gate/up are fused into one matmul each: fewer, larger GEMMs,
which is what both AMX on CPU and tensor cores want for small batches. Under tensor parallelism
the model is built with one rank's heads and MLP columns (engine/model/parallel_layers.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.engine.model.config_fields import gguf_config_fields, hf_config_fields, refuse_yarn
from kvserve.engine.model.decoder_lm import DecoderLM, PreNormBlock
from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model.gguf_metadata import GGUFFields
from kvserve.engine.model.hf_config import qwen_window_layers
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import ModelConfigError
from kvserve.engine.model.model_family import CheckpointLayout, GGUFTensor, ModelFamily, Split, WeightTarget
from kvserve.engine.model.rms_norm import RMSNorm
from kvserve.engine.model.rope import RotaryEmbedding
from kvserve.engine.model.self_attention import SelfAttention
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel

# The Llama family's attention is the plain case of SelfAttention (no q/k norm, the usual scale).
Attention = SelfAttention


class LlamaForCausalLM(DecoderLM):
    def __init__(self, config: ModelConfig, parallel: TensorParallel = SINGLE) -> None:
        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps)

        # Mistral's sliding window is every layer's, a windowed Qwen2's its upper layers' (each
        # SelfAttention declares its window in its cache spec).
        layers = [PreNormBlock(SelfAttention(config, parallel, sliding_window=config.layer_window(i)),
                               GatedMLP(config.hidden_size, config.intermediate_size, parallel), norm(), norm())
                  for i in range(config.num_layers)]
        super().__init__(config, layers, norm(), [RotaryEmbedding(config)], parallel)

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        return self.rotary_embs[0]


# ---------------------------------------------------------------------------- config parsing


def config_from_hf(architecture: str, hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelConfig:
    if architecture == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ModelConfigError("Llama checkpoints with attention_bias/mlp_bias (o_proj/MLP biases) are not supported")
    values = hf_config_fields(architecture, hf, generation)
    sliding_window = hf.get("sliding_window")
    if architecture == "mistral" and sliding_window:
        # Served with the window: every layer attends to the last `sliding_window` positions
        # (Mistral 7B v0.1), and its cache holds only those.
        values["sliding_window"] = int(sliding_window)
    elif architecture == "qwen2":
        # With use_sliding_window, the layers from max_window_layers on attend within the window.
        values["sliding_window"], values["window_layers"] = qwen_window_layers(hf, values["num_layers"])
    refuse_yarn(values, "Llama-family")
    return ModelConfig(**{**values, "attention_bias": architecture == "qwen2"})


ROPE_FREQS = "rope_freqs.weight"


def config_from_gguf(architecture: str, fields: GGUFFields) -> ModelConfig:
    values = gguf_config_fields(architecture, fields)
    scaling_type = fields.optional("rope.scaling.type")
    if scaling_type in ("linear", "dynamic"):
        values["rope_scaling"] = {"rope_type": scaling_type, "factor": float(fields.get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelConfigError(f"{fields.path}: GGUF rope scaling {scaling_type!r} is not supported")
    # Llama 3.1 GGUFs carry their llama3 rope scaling as a `rope_freqs.weight` tensor instead of metadata.
    freq_factors = fields.small_tensor(ROPE_FREQS)
    if freq_factors is not None:
        values["rope_freq_factors"] = tuple(float(f) for f in freq_factors)
    if architecture != "qwen2":  # (a Qwen2 window is its upper layers', which a GGUF cannot say)
        window = fields.optional("attention.sliding_window")
        values["sliding_window"] = int(window) if window and window < values["max_position_embeddings"] else None
    return ModelConfig(**values)


def gguf_window_note(fields: GGUFFields) -> str | None:
    """What to tell a user loading a GGUF whose config.json had a window the GGUF does not carry:
    llama.cpp's converter writes no `{arch}.attention.sliding_window` for its `llama` (Mistral
    included) and `qwen2` architectures, and llama.cpp serves them with full attention."""
    if fields.optional("attention.sliding_window"):
        return None
    name = " ".join(str(fields.general(k) or "") for k in ("general.name", "general.basename")).lower()
    if fields.architecture == "llama" and "mistral" in name:
        return (f"{fields.path}: this GGUF carries no sliding window (llama.cpp's converter writes none for "
                "Mistral): it is served with full attention on every layer, as llama.cpp serves it. Mistral 7B "
                "v0.1 was trained with a 4,096-token window: serve its Hugging Face folder to keep the window")
    return None


# ---------------------------------------------------------------------------- checkpoint layout


def embedding_targets(config: ModelConfig) -> list[WeightTarget]:
    """The embedding, the final norm and (untied) lm_head: named alike in every family here."""
    targets = [WeightTarget("embed_tokens.weight", ("model.embed_tokens.weight",), Split.VOCAB),
               WeightTarget("norm.weight", ("model.norm.weight",))]
    if not config.tie_word_embeddings:
        targets.append(WeightTarget("lm_head.weight", ("lm_head.weight",), Split.VOCAB))
    return targets


def tied_copies(config: ModelConfig) -> frozenset[str]:
    """Some tied checkpoints store a copy of the embedding as lm_head anyway."""
    return frozenset({"lm_head.weight"}) if config.tie_word_embeddings else frozenset()


BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm")


def block_targets(src: str, dst: str, norms: tuple[str, ...] = BLOCK_NORMS) -> list[WeightTarget]:
    """A block's norms and its row-parallel projections (o_proj, down_proj), named alike in
    every family here; the fused column-parallel ones are each family's."""
    return [*(WeightTarget(f"{dst}{n}.weight", (f"{src}{n}.weight",)) for n in norms),
            WeightTarget(dst + "self_attn.o_proj.weight", (src + "self_attn.o_proj.weight",), Split.ROW),
            WeightTarget(dst + "mlp.down_proj.weight", (src + "mlp.down_proj.weight",), Split.ROW)]


def checkpoint_layout(config: ModelConfig, norms: tuple[str, ...] = BLOCK_NORMS) -> CheckpointLayout:
    """Our fused modules (qkv_proj, gate_up_proj) from transformers' separate projections;
    `norms`: the block's norms (Gemma has four)."""
    targets = embedding_targets(config)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        targets += [
            WeightTarget(dst + "self_attn.qkv_proj.weight",
                         tuple(f"{src}self_attn.{p}_proj.weight" for p in "qkv"), Split.COLUMN),
            WeightTarget(dst + "mlp.gate_up_proj.weight",
                         (src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"), Split.COLUMN),
            *block_targets(src, dst, norms),
        ]
        if config.attention_bias:
            targets.append(WeightTarget(dst + "self_attn.qkv_proj.bias",
                                        tuple(f"{src}self_attn.{p}_proj.bias" for p in "qkv"), Split.COLUMN))
    return CheckpointLayout(tuple(targets), tied_copies(config))


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


def gguf_block_tensor(name: str) -> tuple[str, str] | None:
    """("3", "attn_q.weight") for "blk.3.attn_q.weight"; None for a tensor outside the blocks."""
    block, _, rest = name.partition(".")[2].partition(".")
    return (block, rest) if name.startswith("blk.") and block.isdigit() else None


def gguf_place(name: str, layer_names: Mapping[str, str], model: str) -> tuple[str, str]:
    """A block tensor's (block, GGUF name within it), or a clear error naming the family."""
    found = gguf_block_tensor(name)
    if found is None or found[1] not in layer_names:
        raise ModelConfigError(f"GGUF tensor {name!r} has no place in a {model} model "
                               "(mixture-of-experts and multimodal GGUFs are not supported)")
    return found


def gguf_tensor(config: ModelConfig, name: str) -> GGUFTensor | None:
    if name == ROPE_FREQS:
        return None  # read into the config (rope_freq_factors)
    if name in GGUF_GLOBAL_NAMES:
        return GGUFTensor(GGUF_GLOBAL_NAMES[name])
    block, rest = gguf_place(name, GGUF_LAYER_NAMES, "dense Llama-family")
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
