"""DeepSeek-V2/V3 (latent attention, MoE) served through the paged latent cache: greedy tokens
equal transformers' in float32 for V2-Lite (plain q, softmax routing, YaRN), V2 (q LoRA,
group-limited routing) and V3 (sigmoid routing with the correction bias, grouped top-k, YaRN)
under plain batching, chunked prefill, prefix hits and preemption; the absorbed attention equals
the decompressed form; the cache holds one latent per token and layer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.config import ConfigError
from kvserve.engine.model.deepseek import DeepseekForCausalLM
from kvserve.engine.model.deepseek_config import DeepseekConfig
from kvserve.engine.model.mla_attention import MLAAttention
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model.registry import load_model_config, model_config_from_hf_dict
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.worker.kv_cache_sizing import layer_kv_specs
from kvserve.kernels import AttentionMetadata, TorchAttentionBackend
from kvserve.paging import KVCacheConfig, KVCacheManager, MLAAttentionSpec, group_layers
from kvserve.scheduler import Scheduler, SchedulerConfig
from tests.engine.conftest import transformers_greedy
from tests.engine.greedy_check import near_tie_divergences
from tests.engine.test_layer_groups import run  # greedy, 10 tokens, EOS ignored
from tests.engine.tiny_deepseek import COMMON, VARIANTS, write_tiny_deepseek, write_tiny_deepseek_gguf

BLOCK = 8
MAX_TOKENS = 10
PROMPTS = {
    "a": [(5 * i + 3) % 90 + 3 for i in range(21)],
    "b": [(7 * i + 2) % 90 + 3 for i in range(9)],
    "c": [(5 * i + 3) % 90 + 3 for i in range(21)][:16] + [40, 41, 42],  # shares a's first two blocks
    "d": [(11 * i + 5) % 90 + 3 for i in range(30)],
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory) -> tuple[str, Path, object, dict]:
    import transformers

    path = write_tiny_deepseek(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    references = transformers_greedy(hf, list(PROMPTS.values()), MAX_TOKENS)
    return request.param, path, hf, dict(zip(PROMPTS, references))


def engine_parts(path: Path, num_blocks: int, source: str = "hf", **scheduler_options) -> tuple[Scheduler, ModelRunner]:
    config, model = load_model(ModelSource(source, path), torch.float32, torch.device("cpu"))
    kv_config = KVCacheConfig(num_blocks, BLOCK, group_layers(model.kv_cache_specs("float32", 4)))
    runner = ModelRunner(model, config, kv_config, torch.float32, TorchAttentionBackend(), torch.device("cpu"), (2,))
    scheduler_options.setdefault("max_model_len", 128)
    return Scheduler(SchedulerConfig(**scheduler_options), KVCacheManager.from_config(kv_config)), runner


SCENARIOS = {
    "batched": dict(num_blocks=64, max_num_batched_tokens=256),
    "chunked": dict(num_blocks=64, max_num_batched_tokens=7),  # prompts cross blocks mid-chunk
    "prefix-hits": dict(num_blocks=64, max_num_batched_tokens=256, max_num_seqs=1),  # c reuses a's blocks
    "preempted": dict(num_blocks=12, max_num_batched_tokens=256, max_model_len=48),  # 96 slots for ~100 tokens
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_equal_transformers(tiny, scenario: str) -> None:
    variant, path, _, references = tiny
    scheduler, runner = engine_parts(path, **SCENARIOS[scenario])
    outputs, steps = run(scheduler, runner, dict(PROMPTS))
    notes = near_tie_divergences([outputs[r] for r in PROMPTS], [references[r] for r in PROMPTS])
    assert not notes, f"{variant}: {notes}"
    if scenario == "prefix-hits":
        assert scheduler.kv_cache_manager.stats().prefix_cache_hits >= 16
    if scenario == "preempted":
        assert any(step.preempted_request_ids for step in steps), "the workload was meant to preempt"
    assert scheduler.kv_cache_manager.stats().blocks_used == 0


def test_the_latent_cache_holds_one_latent_per_token_and_layer(tiny) -> None:
    _, path, _, _ = tiny
    _, runner = engine_parts(path, num_blocks=10, max_model_len=80)
    latent = COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]
    assert runner.model.kv_cache_specs("float32", 4) == [MLAAttentionSpec(32, 16, "float32", 4)] * 3
    # (kv_lora_rank + rope_dim) x 4 bytes per token per layer, nothing else: 10 blocks x 8 tokens x 3 layers.
    assert runner.kv_cache_tensors.num_bytes == 10 * BLOCK * 3 * latent * 4
    for keys, values in runner.kv_caches:
        assert keys.shape == (10, 1, BLOCK, latent) and keys.dtype == torch.float32
        assert values.shape == (10, 1, BLOCK, COMMON["kv_lora_rank"]) and values.data_ptr() == keys.data_ptr()


def _decompressed_attention(attn: MLAAttention, x: torch.Tensor, rope) -> torch.Tensor:
    """The form transformers computes: per-head K and V from the latents, causal attention."""
    q_nope, q_rope, latent = attn.project(x, rope)
    c, k_rope = latent[:, 0, : attn.kv_lora_rank], latent[:, :, attn.kv_lora_rank:]
    kv = F.linear(c, attn.kv_b_proj.weight).view(-1, attn.num_heads, attn.nope_dim + attn.v_head_dim)
    k_nope, v = kv.split([attn.nope_dim, attn.v_head_dim], dim=-1)
    q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)
    k = torch.cat((k_nope, k_rope.expand(-1, attn.num_heads, -1)), dim=-1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), is_causal=True, scale=attn.scale)
    return attn.o_proj(out.transpose(0, 1).reshape(len(x), -1))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_absorbed_attention_equals_the_decompressed_form(tiny, dtype: torch.dtype, tolerance: float) -> None:
    # A 21-token prompt as one prefill, then 3 decodes: each output row vs decompressed attention
    # over the same context. Tolerance (absolute, outputs of magnitude ~1): 2e-5 in float32,
    # 3e-2 in bfloat16 (the absorbed query is rounded once more).
    _, path, _, _ = tiny
    config, model = load_model(ModelSource("hf", path), dtype, torch.device("cpu"))
    attn = model.layers[1].self_attn
    torch.manual_seed(1)
    x = torch.randn(24, config.hidden_size, dtype=dtype)
    rope = model.rotary_emb(torch.arange(24), dtype)
    expected = _decompressed_attention(attn, x, rope)
    cache = torch.zeros(4, 1, BLOCK, attn.kv_lora_rank + attn.rope_dim, dtype=dtype)
    kv_cache = (cache, cache[..., : attn.kv_lora_rank])
    backend = TorchAttentionBackend()
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    steps = [(0, 21)] + [(p, p + 1) for p in range(21, 24)]
    for start, stop in steps:
        positions = torch.arange(start, stop)
        meta = AttentionMetadata(slot_mapping=(table[0, positions // BLOCK] * BLOCK + positions % BLOCK).long(),
                                 block_tables=table, seq_lens=torch.tensor([stop], dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, stop - start], dtype=torch.int32),
                                 max_query_len=stop - start, max_seq_len=stop, num_decodes=int(stop - start == 1))
        step_rope = tuple(t[start:stop] for t in rope)
        got = attn(x[start:stop], step_rope, kv_cache, meta, backend)
        torch.testing.assert_close(got.float(), expected[start:stop].float(), atol=tolerance, rtol=tolerance)


def test_config_json_fields_and_yarn_scale() -> None:
    # DeepSeek-V3's own config.json (transformers 4 style: rope_scaling with "type").
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
          "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
          "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
          "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
          "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
          "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"},
          "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "num_nextn_predict_layers": 1}
    config = model_config_from_hf_dict(hf)
    assert isinstance(config, DeepseekConfig) and config.architecture == "deepseek_v3"
    assert (config.q_lora_rank, config.kv_lora_rank, config.head_dim, config.qk_head_dim) == (1536, 512, 64, 192)
    assert (config.scoring_func, config.topk_method, config.n_group, config.topk_group) == ("sigmoid", "noaux_tc", 8, 4)
    mscale = 0.1 * math.log(40) + 1.0
    assert config.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert config.kv_shape().bytes_per_token(2) == 61 * 576 * 2
    assert not config.is_moe_layer(2) and config.is_moe_layer(3)


def test_a_tiny_model_is_recognised_from_its_folder(tiny) -> None:
    variant, path, _, _ = tiny
    config = load_model_config(path)
    assert config.architecture == ("deepseek_v3" if variant == "v3" else "deepseek_v2")
    assert (config.q_lora_rank is None) == (variant == "v2-lite")
    model = DeepseekForCausalLM(config)
    assert sum(1 for layer in model.layers if hasattr(layer.mlp, "experts")) == 2  # layer 0 is dense


@pytest.mark.slow
@pytest.mark.parametrize("split_kv_b", [False, True], ids=["kv_b", "k_b-v_b"])
def test_a_gguf_as_llama_cpp_lays_out_deepseek2_gives_the_same_tokens(tiny, tmp_path, split_kv_b: bool) -> None:
    variant, path, _, references = tiny
    gguf_path = write_tiny_deepseek_gguf(tmp_path / f"{variant}.gguf", path, split_kv_b)
    hf_config, gguf_config = load_model_config(path), load_model_config(gguf_path)
    for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "scoring_func",
                  "topk_method", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace"):
        assert getattr(gguf_config, field) == getattr(hf_config, field), field
    assert gguf_config.softmax_scale == pytest.approx(hf_config.softmax_scale)
    scheduler, runner = engine_parts(gguf_path, num_blocks=64, source="gguf", max_num_batched_tokens=256)
    outputs, _ = run(scheduler, runner, dict(PROMPTS))
    assert not near_tie_divergences([outputs[r] for r in PROMPTS], [references[r] for r in PROMPTS])


def test_an_int8_kv_cache_is_refused_with_the_option_named(tiny) -> None:
    """A latent has no per-head rows for int8's per-token scales: the engine says so at start-up."""
    _, path, _, _ = tiny
    _, model = load_model(ModelSource("hf", path), torch.float32, torch.device("cpu"))
    with pytest.raises(ConfigError, match="int8 is not supported for latent attention") as error:
        layer_kv_specs(model, torch.int8)
    assert error.value.option == "--kv-cache-dtype"
