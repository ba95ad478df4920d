"""The config.json files the families ship with (their deciding fields, as published) parse to
what the model needs: Qwen3's head_dim, Phi-3's window cap, Phi-4-mini's partial rotary and
LongRoPE, Gemma 3's layer pattern, rope per layer kind and defaults, Gemma 2's alternating layers
and soft-caps; and what kvserve cannot serve is refused with a clear error."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.model.model_errors import ModelConfigError
from kvserve.engine.model.registry import family_of, model_config_from_hf_dict
from kvserve.engine.model.tensor_parallel import SINGLE

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_size": 4096,
            "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
            "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
            "use_sliding_window": False, "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645}
PHI3_MINI_4K = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
                "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
                "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
                "vocab_size": 32064, "bos_token_id": 1, "eos_token_id": 32000}
PHI4_MINI = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
             "max_position_embeddings": 131072, "num_attention_heads": 24, "num_hidden_layers": 32,
             "num_key_value_heads": 8, "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
             "rope_scaling": {"long_factor": [1.0 + i / 8 for i in range(48)], "short_factor": [1.0] * 48,
                              "type": "longrope"},
             "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "vocab_size": 200064,
             "bos_token_id": 199999, "eos_token_id": 199999}
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
             "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
             "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
             "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
             "sliding_window_pattern": 6, "vocab_size": 262144}
GEMMA2_2B_IT = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
                "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
                "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
                "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
                "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
                "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
                "sliding_window": 4096, "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True,
                "vocab_size": 256000}


def test_qwen3_takes_head_dim_from_the_config():
    config = model_config_from_hf_dict(QWEN3_8B)
    assert (config.architecture, config.head_dim, config.num_kv_heads) == ("qwen3", 128, 8)
    assert config.max_position_embeddings == 40960 and not config.attention_bias


def test_phi3_mini_4k_attends_within_its_window_on_every_layer():
    config = model_config_from_hf_dict(PHI3_MINI_4K)
    assert config.sliding_window == 2047 and config.max_position_embeddings == 4096
    assert config.rotary_dim == 96 and config.rope_scaling is None


def test_phi4_mini_rotates_three_quarters_of_each_head_with_long_rope():
    config = model_config_from_hf_dict(PHI4_MINI)
    assert config.head_dim == 128 and config.rotary_dim == 96
    assert config.sliding_window is None and config.max_position_embeddings == 131072  # 262144 covers it all
    assert config.rope_scaling["rope_type"] == "longrope" and config.tie_word_embeddings
    with torch.device("meta"):
        model = family_of(config).build(config, SINGLE)
    rope = model.rotary_embs[0]
    assert rope.inv_freq.shape == (48,)
    # The long factors (131072 > 4096) and transformers' attention factor for a 32x longer context.
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    base = 1.0 / 10000.0 ** (torch.arange(0, 96, 2).float() / 96)
    torch.testing.assert_close(rope.inv_freq, base / torch.tensor(PHI4_MINI["rope_scaling"]["long_factor"]))


def test_gemma3_1b_has_every_sixth_layer_global_with_its_own_rope():
    config = model_config_from_hf_dict(GEMMA3_1B)
    assert config.architecture == "gemma3" and config.tie_word_embeddings  # Gemma's default: tied
    assert [i for i in range(26) if config.is_global(i)] == [5, 11, 17, 23]
    assert (config.rope_theta, config.local_rope_theta, config.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert config.local_window == 512 and config.sliding_window is None and config.max_position_embeddings == 32768
    shape = config.kv_shape()
    assert (shape.sliding_window, shape.num_window_layers) == (512, 22)
    assert config.eos_token_ids == (1, 106)
    with torch.device("meta"):
        model = family_of(config).build(config, SINGLE)
    assert model.rope_of_layer[:6] == (0, 0, 0, 0, 0, 1) and model.embed_scale == pytest.approx(1152**0.5)
    assert model.layers[0].self_attn.scale == pytest.approx(256**-0.5)
    specs = model.kv_cache_specs("bfloat16", 2)
    assert [getattr(spec, "sliding_window", None) for spec in specs[:6]] == [512] * 5 + [None]


def test_gemma3_in_transformers5_layer_types_and_ropes_per_kind():
    hf = {k: v for k, v in GEMMA3_1B.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling",
                                                          "sliding_window_pattern")}
    hf |= {"layer_types": ["sliding_attention", "full_attention"] * 13,
           "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    config = model_config_from_hf_dict(hf)
    assert config.sliding_window_pattern == 2 and config.rope_scaling["factor"] == 8.0
    with pytest.raises(ModelConfigError, match="not every n-th one global"):
        model_config_from_hf_dict({**hf, "layer_types": ["sliding_attention", "full_attention", "full_attention"] * 9})


def test_gemma2_2b_it_alternates_window_and_global_layers_with_soft_caps():
    config = model_config_from_hf_dict(GEMMA2_2B_IT)
    assert config.architecture == "gemma2" and config.tie_word_embeddings and not config.qk_norm
    assert [i for i in range(26) if config.is_global(i)] == list(range(1, 26, 2))  # even layers local
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling) == (1e4, 1e4, None)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert (config.local_window, config.query_pre_attn_scalar, config.eos_token_ids) == (4096, 256.0, (1, 107))
    assert (config.kv_shape().sliding_window, config.kv_shape().num_window_layers) == (4096, 13)
    with torch.device("meta"):
        model = family_of(config).build(config, SINGLE)
    attention = [layer.self_attn for layer in model.layers]
    assert {a.soft_cap for a in attention} == {50.0} and all(a.q_norm is None for a in attention)
    assert model.final_logit_soft_cap == 30.0 and model.embed_scale == pytest.approx(2304**0.5)
    assert [getattr(spec, "sliding_window", None) for spec in model.kv_cache_specs("bfloat16", 2)[:4]] == [4096, None] * 2
    # transformers 5 writes the alternation as layer_types and the rope as rope_parameters.
    hf5 = {k: v for k, v in GEMMA2_2B_IT.items() if k != "rope_theta"}
    hf5 |= {"layer_types": ["sliding_attention", "full_attention"] * 13,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert model_config_from_hf_dict(hf5) == config


def test_gemma3_with_attention_soft_capping_caps_every_layer():
    config = model_config_from_hf_dict({**GEMMA3_1B, "attn_logit_softcapping": 50.0})
    assert config.attn_logit_softcapping == 50.0 and config.qk_norm
    with torch.device("meta"):
        model = family_of(config).build(config, SINGLE)
    assert {layer.self_attn.soft_cap for layer in model.layers} == {50.0}
    assert model_config_from_hf_dict(GEMMA3_1B).attn_logit_softcapping is None


def test_a_negative_gemma_soft_cap_is_refused_by_name():
    with pytest.raises(ModelConfigError, match="attn_logit_softcapping must be positive"):
        model_config_from_hf_dict({**GEMMA2_2B_IT, "attn_logit_softcapping": -50.0})
