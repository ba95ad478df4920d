"""The Hugging Face directory path without transformers: sharded safetensors, tied/untied heads,
and clear errors for unsupported architectures, missing and damaged weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from kvserve.engine.model.model_errors import CorruptModelError, UnsupportedArchitectureError
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource
from tests.engine.test_model_gguf import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, hf_weights

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN,
          "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 2}


def write_dir(path: Path, weights: dict[str, np.ndarray], config: dict, shards: int = 1) -> Path:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    if shards == 1:
        save_file(weights, path / "model.safetensors")
        return path
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        save_file(part, path / shard)
        weight_map |= dict.fromkeys(part, shard)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def untied_weights() -> dict[str, np.ndarray]:
    weights = hf_weights(seed=1)
    weights["lm_head.weight"] = np.random.default_rng(2).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    return weights


def test_sharded_untied_checkpoint_loads_every_weight(tmp_path):
    weights = untied_weights()
    path = write_dir(tmp_path / "m", weights, CONFIG, shards=3)
    config, model = load_model(ModelSource("hf", path), torch.float32, torch.device("cpu"))
    assert not config.tie_word_embeddings
    assert np.array_equal(model.lm_head.weight.numpy(), weights["lm_head.weight"])
    assert np.array_equal(model.layers[1].self_attn.o_proj.weight.numpy(),
                          weights["model.layers.1.self_attn.o_proj.weight"])


def test_tied_checkpoint_ignores_a_stored_lm_head_copy(tmp_path):
    path = write_dir(tmp_path / "m", untied_weights(), {**CONFIG, "tie_word_embeddings": True})
    _, model = load_model(ModelSource("hf", path), torch.bfloat16, torch.device("cpu"))
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.embed_tokens.weight.dtype == torch.bfloat16


def test_missing_weight_is_named(tmp_path):
    weights = untied_weights()
    del weights["model.layers.1.mlp.up_proj.weight"]
    path = write_dir(tmp_path / "m", weights, CONFIG)
    with pytest.raises(CorruptModelError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_model(ModelSource("hf", path), torch.float32, torch.device("cpu"))


def test_weights_that_do_not_fit_the_config_are_named(tmp_path):
    path = write_dir(tmp_path / "m", untied_weights(), {**CONFIG, "intermediate_size": FFN * 2})
    with pytest.raises(CorruptModelError, match="gate_up_proj.*shape"):
        load_model(ModelSource("hf", path), torch.float32, torch.device("cpu"))


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    path = write_dir(tmp_path / "m", untied_weights(), CONFIG)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError, match="model.safetensors cannot be read"):
        load_model(ModelSource("hf", path), torch.float32, torch.device("cpu"))


def test_unsupported_hf_architecture_is_named(tmp_path):
    path = write_dir(tmp_path / "m", untied_weights(), {**CONFIG, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel.*llama, mistral, qwen2"):
        load_model(ModelSource("hf", path), torch.float32, torch.device("cpu"))
