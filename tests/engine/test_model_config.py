"""ModelConfig: parsing transformers 4 and 5 config.json styles and GGUF metadata, validation."""

from __future__ import annotations

import json

import pytest

from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.registry import load_model_config, model_config_from_hf_dict
from kvserve.engine.model.model_errors import ModelConfigError, ModelNotFoundError, UnsupportedArchitectureError

LLAMA3_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def test_llama3_in_transformers4_style():
    config = model_config_from_hf_dict(LLAMA3_HF)
    assert (config.architecture, config.head_dim, config.num_kv_heads) == ("llama", 128, 8)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.kv_shape().bytes_per_token(2) == 2 * 32 * 8 * 128 * 2  # 128 KiB per token in bf16


def test_transformers5_rope_parameters_style_equals_the_old_style():
    new_style = {k: v for k, v in LLAMA3_HF.items() if k not in ("rope_theta", "rope_scaling")}
    new_style["rope_parameters"] = {**LLAMA3_HF["rope_scaling"], "rope_theta": 500000.0}
    assert model_config_from_hf_dict(new_style) == model_config_from_hf_dict(LLAMA3_HF)


def test_default_rope_has_no_scaling_and_generation_config_adds_eos():
    hf = {**LLAMA3_HF, "rope_scaling": None, "eos_token_id": 2}
    config = model_config_from_hf_dict(hf, {"eos_token_id": [2, 7]})
    assert config.rope_scaling is None
    assert config.eos_token_ids == (2, 7)


def test_qwen2_has_qkv_bias_and_mistral_is_served_with_its_window():
    base = {k: v for k, v in LLAMA3_HF.items() if k != "rope_scaling"}
    qwen = model_config_from_hf_dict({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096,
                                      "use_sliding_window": False})
    assert qwen.attention_bias and qwen.max_position_embeddings == 131072 and qwen.sliding_window is None
    # A windowed Qwen2 is served with its window on the layers from max_window_layers on
    # (tests/engine/test_qwen2_window.py), over the whole context.
    windowed_qwen = model_config_from_hf_dict({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096,
                                               "use_sliding_window": True, "max_window_layers": 1})
    assert windowed_qwen.max_position_embeddings == 131072 and windowed_qwen.sliding_window == 4096
    assert windowed_qwen.layer_window(0) is None and windowed_qwen.layer_window(1) == 4096
    mistral = model_config_from_hf_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096,
                                         "head_dim": 96})
    assert not mistral.attention_bias and mistral.head_dim == 96
    assert mistral.sliding_window == 4096 and mistral.max_position_embeddings == 131072  # the whole context, windowed
    no_window = model_config_from_hf_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert no_window.sliding_window is None


def test_unsupported_architecture_names_it_and_the_supported_ones():
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel.*llama, mistral, qwen2"):
        model_config_from_hf_dict({**LLAMA3_HF, "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 5}, "multiple of num_kv_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling needs"),
        ({"eos_token_id": 200000}, "outside the vocabulary"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_inconsistent_configs_are_rejected(change, message):
    with pytest.raises(ModelConfigError, match=message):
        model_config_from_hf_dict({**LLAMA3_HF, **change})


def test_config_is_frozen_including_its_rope_scaling():
    config = model_config_from_hf_dict(LLAMA3_HF)
    with pytest.raises(AttributeError):
        config.num_layers = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.rope_scaling["factor"] = 1.0  # type: ignore[index]


def test_smollm2_from_gguf_metadata(smollm2_source):
    config = load_model_config(smollm2_source.path)
    assert config == ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rope_scaling=None,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=8192, tie_word_embeddings=True,
        attention_bias=False, bos_token_id=1, eos_token_ids=(2,),
    )
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.kv_shape().bytes_per_token(2) == 22.5 * 1024  # DESIGN.md's figure


def test_load_model_config_from_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_HF))
    assert load_model_config(tmp_path) == model_config_from_hf_dict(LLAMA3_HF)
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model_config(tmp_path / "nowhere")
