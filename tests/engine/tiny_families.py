"""Tiny random-weight models of the families beyond Llama (and of Llama 3.x's rope scaling),
built from transformers' own config classes (seeded; a few layers, GQA, each family's distinctive
features switched on), saved as HF folders, and converted to GGUF the way llama.cpp's convert_hf_to_gguf.py lays each family out
(its tensor names from the gguf package's own name map, its metadata keys, its edits: Llama's
Q/K permutation, Gemma's +1 on norms, Phi-3's rope factor tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.numpy import load_file

GEMMA3_WINDOW = 32  # two 16-token blocks: the test prompts are several windows long
# Gemma 2's caps, scaled down from the shipped 50 / 30 so that they bite on a tiny random model's
# scores and logits (tests/engine/test_model_families.py checks that they do).
GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP = 2.0, 3.0
VOCAB = 49152  # SmolLM2's tokenizer serves every tiny model


def tiny_config(name: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    if name == "qwen3":
        # head_dim 32 is not hidden / heads (16): the config's head_dim must win.
        return transformers.Qwen3Config(**common, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if name == "gemma3":
        # Gemma 3's shape: 5 local : 1 global (the pattern llama.cpp assumes), its own rope base per
        # kind, linear rope scaling on the global layers only, query_pre_attn_scalar = head_dim (as
        # the 1B/4B/12B ship it; a GGUF cannot say otherwise).
        return transformers.Gemma3TextConfig(
            **common, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=GEMMA3_WINDOW,
            sliding_window_pattern=6, final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    if name == "gemma2":
        # Gemma 2's shape: local (even) and global (odd) layers alternating, one rope base, no q/k
        # norms, attention-logit and final-logit soft-capping.
        return transformers.Gemma2Config(
            **common, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=GEMMA3_WINDOW,
            attn_logit_softcapping=GEMMA2_ATTN_CAP, final_logit_softcapping=GEMMA2_FINAL_CAP,
            hidden_activation="gelu_pytorch_tanh", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if name == "phi3":
        # Phi-4-mini's shape of rope: partial rotary (half of each 16-dim head) and LongRoPE with an
        # original context of 64 < 512, so the long factors apply.
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 64,
                "long_factor": [1.0, 1.7, 3.1, 6.5], "short_factor": [1.0, 1.1, 1.3, 1.6]}
        return transformers.Phi3Config(**{**common, "hidden_size": 64}, num_hidden_layers=2,
                                       original_max_position_embeddings=64, partial_rotary_factor=0.5,
                                       tie_word_embeddings=False, sliding_window=GEMMA3_WINDOW, rope_parameters=rope)
    if name == "llama3":
        # Llama 3.x's llama3 rope scaling, with an original context short enough (64) that every
        # frequency band (kept, divided, interpolated) matters within the test prompts.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(**common, num_hidden_layers=2, tie_word_embeddings=False, rope_parameters=rope)
    raise ValueError(name)


def write_tiny_model(name: str, path: Path, tokenizer, seed: int = 0) -> Path:
    """A seeded random model saved as an HF folder with SmolLM2's tokenizer (and chat template)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:  # Gemma's norms start at 0, the others at 1: make them matter
                parameter.add_(torch.randn_like(parameter) * 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -------------------------------------------------------------- GGUF, as llama.cpp's converter writes it

GGUF_ARCH = {"Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Gemma2ForCausalLM": "gemma2",
             "Phi3ForCausalLM": "phi3", "LlamaForCausalLM": "llama"}


def _rope(config: dict) -> dict:
    params = config.get("rope_parameters") or {}
    return params.get("full_attention", params)


def write_llama_cpp_gguf(hf_dir: Path, path: Path) -> Path:
    """The tiny HF folder's weights and config as a GGUF (F32 tensors, no tokenizer: the model tests
    drive token ids directly)."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["architectures"][0]]
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_bos_token_id(config["bos_token_id"])
    rope = _rope(config)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    extra: dict[str, np.ndarray] = {}
    if arch in ("gemma3", "gemma2"):
        writer.add_sliding_window(config["sliding_window"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    if arch == "phi3":
        rotary_dim = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
        writer.add_rope_dimension_count(rotary_dim)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = config["max_position_embeddings"] / rope["original_max_position_embeddings"]
            writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(rope["original_max_position_embeddings"]))))
            extra["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
            extra["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_freqs(rope, head_dim)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), layers)
    weights = load_file(hf_dir / "model.safetensors")
    for name, array in weights.items():
        if name == "lm_head.weight" and arch in ("gemma3", "gemma2"):
            continue  # the converter skips it (tied)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            array = array.reshape(n, 2, array.shape[0] // n // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
        if arch in ("gemma3", "gemma2") and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp's RMSNorm scales by w; Gemma's by (1 + w)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"{arch}: no GGUF name for {name}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    for name, array in extra.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: llama3 scaling as per-frequency divisors."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)
