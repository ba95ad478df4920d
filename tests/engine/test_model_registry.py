"""The model registry: config.json class names and GGUF architectures pick a family, unknown ones
are refused with the supported list, and the runner and the compile wrapper drive a decoder that
is not Llama's (only engine/model/protocol.py's seam) eagerly and compiled alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model.llama import LLAMA, Attention
from kvserve.engine.model.model_errors import UnsupportedArchitectureError
from kvserve.engine.model.protocol import CausalLM, DecoderLayer, Rope
from kvserve.engine.model.registry import (
    FAMILIES, SUPPORTED_ARCHITECTURES, family_of, hf_architecture_name, model_config_from_hf_dict,
)
from kvserve.engine.model.rms_norm import RMSNorm
from kvserve.engine.model.rope import RotaryEmbedding
from kvserve.engine.model_runner import ModelRunner
from kvserve.kernels import KVCache, TorchAttentionBackend
from kvserve.paging import FullAttentionSpec, KVCacheConfig, group_layers
from tests.engine.test_model_config import LLAMA3_HF
from tests.engine.test_model_runner import CONFIG, PLAN, fresh_seqs, run_steps


def test_each_config_json_class_name_picks_its_family_and_maps_back() -> None:
    for family in FAMILIES:
        for architecture, hf_class in family.architectures.items():
            config = model_config_from_hf_dict({**LLAMA3_HF, "architectures": [hf_class]})
            assert config.architecture == architecture
            assert family_of(config) is family
            assert hf_architecture_name(architecture) == hf_class
    assert SUPPORTED_ARCHITECTURES[:5] == ("llama", "mistral", "qwen2", "deepseek_v2", "deepseek_v3")
    assert {"qwen3", "phi3", "gemma3"} <= set(SUPPORTED_ARCHITECTURES)


def test_model_type_alone_picks_the_family_when_architectures_is_absent() -> None:
    hf = {k: v for k, v in LLAMA3_HF.items() if k != "architectures"} | {"model_type": "qwen2"}
    assert model_config_from_hf_dict(hf).attention_bias


def test_an_unknown_architecture_lists_every_supported_one_in_both_spellings() -> None:
    with pytest.raises(UnsupportedArchitectureError) as error:
        model_config_from_hf_dict({**LLAMA3_HF, "architectures": ["GPTNeoXForCausalLM"]})
    message = str(error.value)
    assert "'GPTNeoXForCausalLM' is not supported" in message
    assert ", ".join(SUPPORTED_ARCHITECTURES) in message
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM" in message


class ParallelBlock(nn.Module):
    """GPT-J's layer: attention and MLP read the same normalised input (not Llama's sequence)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, activation=torch.nn.functional.gelu)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta, attention) -> torch.Tensor:
        h = self.norm(x)
        return x + self.self_attn(h, rope, kv_cache, meta, attention) + self.mlp(h)


class ParallelBlockLM(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rope = RotaryEmbedding(config)
        self.layers = nn.ModuleList(ParallelBlock(config) for _ in range(config.num_layers))
        self.ln_f = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    def forward(self, input_ids, positions, kv_caches, attn_metadata, attention) -> torch.Tensor:
        x = self.wte(input_ids)
        rope = self.rope(positions, x.dtype)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, attn_metadata):
            x = layer(x, rope, kv_cache, meta, attention)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def kv_cache_specs(self, dtype: str, dtype_bytes: int) -> list[FullAttentionSpec]:
        return [FullAttentionSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, dtype, dtype_bytes)
                for layer in self.layers]


def _runner(compiled: bool) -> ModelRunner:
    torch.manual_seed(0)
    model = ParallelBlockLM(CONFIG)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    assert isinstance(model, CausalLM) and isinstance(model.layers[0], DecoderLayer)
    kv_cache_config = KVCacheConfig(32, 4, group_layers(model.kv_cache_specs("float32", 4)))
    return ModelRunner(model.eval(), CONFIG, kv_cache_config, torch.float32, TorchAttentionBackend(),
                       torch.device("cpu"), eos_token_ids=(), compiled=compiled)


def test_llama_is_one_family_among_the_registered() -> None:
    assert LLAMA in FAMILIES


@pytest.mark.slow
def test_the_runner_and_the_compile_wrapper_drive_a_decoder_that_is_not_llamas() -> None:
    eager, compiled = _runner(compiled=False), _runner(compiled=True)
    compiled.warm_up()
    eager.warm_up()
    assert compiled.graphs_bound
    expected = run_steps(eager, PLAN, fresh_seqs())
    assert all(len(set(tokens)) > 1 for tokens in expected)  # not degenerate
    assert run_steps(compiled, PLAN, fresh_seqs()) == expected
