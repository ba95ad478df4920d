"""The GGUF path on small files written here: llama.cpp's Q/K permutation is undone exactly,
names map onto our fused module, quantized tensors dequantize, and bad files fail clearly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvserve.engine.model.gguf_checkpoint import unpermute_rope_rows
from kvserve.engine.model.registry import load_model_config
from kvserve.engine.model.model_errors import CorruptModelError, UnsupportedArchitectureError
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K (re-derived from its docs)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(HEADS * HEAD_DIM, 3)
    permuted = llama_cpp_permute(w, HEADS)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rope_rows(permuted, HEADS), w)


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                   p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                   p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, FFN)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama",
               quantize: tuple[str, ...] = (), configure: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """`configure(writer)` adds metadata of its own."""
    writer = gguf.GGUFWriter(path, arch)
    if configure is not None:
        configure(writer)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_eos_token_id(2)
    for name, array in weights.items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.{suffix}"
            if module == "self_attn.q_proj":
                array = llama_cpp_permute(array, HEADS)
            elif module == "self_attn.k_proj":
                array = llama_cpp_permute(array, KV_HEADS)
        if gguf_name in quantize:
            q8 = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_weights_land_in_our_fused_module_unpermuted(tmp_path):
    weights = hf_weights()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, weights, quantize=("blk.1.ffn_down.weight",))
    config, model = load_model(ModelSource("gguf", path), torch.float32, torch.device("cpu"))
    assert config.tie_word_embeddings and config.num_kv_heads == KV_HEADS and config.eos_token_ids == (2,)
    state = model.state_dict()
    qkv = np.concatenate([weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert np.array_equal(state["layers.0.self_attn.qkv_proj.weight"].numpy(), qkv)
    gate_up = np.concatenate([weights["model.layers.0.mlp.gate_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"]])
    assert np.array_equal(state["layers.0.mlp.gate_up_proj.weight"].numpy(), gate_up)
    assert model.lm_head.weight is model.embed_tokens.weight
    # Q8_0 keeps ~8 bits: dequantized within a few percent of the original scale.
    down = weights["model.layers.1.mlp.down_proj.weight"]
    error = np.abs(state["layers.1.mlp.down_proj.weight"].numpy() - down).max()
    assert 0 < error < 0.05 * np.abs(down).max()


def test_bfloat16_load_keeps_rope_frequencies_in_float32(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_weights())
    _, model = load_model(ModelSource("gguf", path), torch.bfloat16, torch.device("cpu"))
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary_emb.inv_freq.dtype == torch.float32


def test_non_finite_weights_are_reported_as_corruption(tmp_path):
    weights = hf_weights()
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    path = tmp_path / "nan.gguf"
    write_gguf(path, weights)
    with pytest.raises(CorruptModelError, match="blk.1.ffn_up.weight.*NaN"):
        load_model(ModelSource("gguf", path), torch.float32, torch.device("cpu"))


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, hf_weights(), arch="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*llama, mistral, qwen2"):
        load_model_config(path)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        load_model(ModelSource("gguf", path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_gguf_is_a_clear_error(tmp_path, keep):
    whole = tmp_path / "tiny.gguf"
    write_gguf(whole, hf_weights())
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CorruptModelError, match="truncated|not a readable GGUF"):
        load_model(ModelSource("gguf", cut), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("content", [b"", b"not a gguf at all" * 100, b"GGUF" + b"\xff" * 64])
def test_garbage_gguf_is_a_clear_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(CorruptModelError, match="download it again"):
        load_model_config(path)


def test_truncated_smollm2_header_is_a_clear_error(smollm2_source, tmp_path):
    cut = tmp_path / "smollm2-cut.gguf"
    with smollm2_source.path.open("rb") as f:
        cut.write_bytes(f.read(4096))  # ends inside the tokenizer metadata
    with pytest.raises(CorruptModelError):
        load_model_config(cut)
