"""A model whose layers keep different caches runs end to end: its layers form two groups, each
request holds one block table per group from one shared pool (exact block ids), the runner lays
the cache out in shared slots, and greedy tokens equal a dense (unpaged) forward of the same
weights under batching, chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.model.llama import Attention, LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.rope import apply_rotary
from kvserve.engine.model_runner import ModelRunner
from kvserve.kernels import TorchAttentionBackend
from kvserve.paging import FullAttentionSpec, KVCacheConfig, KVCacheManager, group_layers
from kvserve.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

BLOCK = 8
CONFIG = ModelConfig(
    architecture="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=8, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
    max_position_embeddings=128, tie_word_embeddings=False, attention_bias=False, bos_token_id=None,
    eos_token_ids=(0,),
)
MHA_LAYERS = (1, 3)  # these keep 4 KV heads (a page twice as large); the others 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def two_kind_model(config: ModelConfig = CONFIG) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for index in MHA_LAYERS:
        model.layers[index].self_attn = Attention(dataclasses.replace(config, num_kv_heads=4))
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return model.eval()


def dense_greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference: the same weights, the whole context recomputed each token, no cache at all."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            positions = torch.arange(len(tokens))
            x = model.embed_tokens(torch.tensor(tokens))
            cos, sin = model.rotary_emb(positions, x.dtype)
            for layer in model.layers:
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
                q = q.view(-1, attn.num_heads, attn.head_dim)
                k = k.view(-1, attn.num_kv_heads, attn.head_dim)
                v = v.view(-1, attn.num_kv_heads, attn.head_dim)
                q, k = apply_rotary(q, k, cos, sin)
                repeat = attn.num_heads // attn.num_kv_heads
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
                out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                     is_causal=True, scale=attn.scale)
                x = x + attn.o_proj(out.transpose(0, 1).reshape(len(tokens), -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            logits = model.compute_logits(model.norm(x)[-1:])
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def engine_parts(num_blocks: int, model_config: ModelConfig = CONFIG, attention=TorchAttentionBackend(),
                 **scheduler_options) -> tuple[Scheduler, ModelRunner]:
    model = two_kind_model(model_config)
    config = KVCacheConfig(num_blocks, BLOCK, group_layers(model.kv_cache_specs("float32", 4)))
    runner = ModelRunner(model, model_config, config, torch.float32, attention, torch.device("cpu"), (0,))
    scheduler_options.setdefault("max_model_len", 128)
    scheduler = Scheduler(SchedulerConfig(**scheduler_options), KVCacheManager.from_config(config))
    return scheduler, runner


def run(scheduler: Scheduler, runner: ModelRunner, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], list]:
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    for request_id, prompt in prompts.items():
        scheduler.add_request(Request(request_id, prompt, GREEDY, eos_token_ids=(0,), arrival_time=0.0))
    steps = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        steps.append(output)
        for update in scheduler.update_from_output(output, runner.execute(output)):
            outputs[update.request.request_id] += update.new_token_ids
    return outputs, steps


PROMPTS = {
    "a": [(5 * i + 3) % 60 + 1 for i in range(21)],
    "b": [(7 * i + 2) % 60 + 1 for i in range(9)],
    "c": [(5 * i + 3) % 60 + 1 for i in range(21)][:16] + [40, 41, 42],  # shares a's first two blocks
}


def test_the_layers_form_two_groups_sharing_slots_with_the_smaller_page_padded():
    model = two_kind_model()
    groups = group_layers(model.kv_cache_specs("float32", 4))
    assert [(g.layer_indices, g.spec.num_kv_heads) for g in groups] == [((0, 2), 2), ((1, 3), 4)]
    config = KVCacheConfig(10, BLOCK, groups)
    runner = ModelRunner(model, CONFIG, config, torch.float32, TorchAttentionBackend(), torch.device("cpu"), (0,))
    # Two slots (two layers per group), pages as large as the 4-head layers'.
    assert len(runner.kv_cache_tensors.slots) == 2
    assert runner.kv_cache_tensors.num_bytes == config.total_bytes == 10 * 2 * (2 * 4 * BLOCK * 8 * 4)
    small, large = runner.kv_caches[0][0], runner.kv_caches[1][0]
    assert small.shape == (10, 2, BLOCK, 8) and large.shape == (10, 4, BLOCK, 8)
    assert small.stride(0) == large.stride(0) == 4 * BLOCK * 8  # the 2-head layers use half of each page
    # Layer 0 and layer 1 are slot 0 of their groups: the same memory.
    assert small.data_ptr() == large.data_ptr()


def test_two_groups_serve_exactly_with_exact_block_ids_and_free_everything():
    scheduler, runner = engine_parts(num_blocks=40, max_num_batched_tokens=64)
    outputs, steps = run(scheduler, runner, {"a": PROMPTS["a"], "b": PROMPTS["b"]})
    model = runner.model
    for request_id in ("a", "b"):
        assert outputs[request_id] == dense_greedy(model, PROMPTS[request_id], 10)
    first = {s.request_id: s for s in steps[0].scheduled}
    # a: 21 tokens = 3 blocks in each group, from the shared pool in order; then b's 2 + 2.
    assert first["a"].new_block_ids == ((0, 1, 2), (3, 4, 5)) and first["b"].new_block_ids == ((6, 7), (8, 9))
    stats = scheduler.kv_cache_manager.stats()
    assert stats.blocks_used == 0 and stats.blocks_free + stats.blocks_cached == 40


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 7},  # chunked prefill: prompts cross blocks mid-chunk
    {"max_num_batched_tokens": 64, "max_num_seqs": 1},  # one at a time: c hits a's cached blocks in both groups
])
def test_two_groups_under_chunking_and_prefix_hits(options):
    scheduler, runner = engine_parts(num_blocks=40, **options)
    outputs, _ = run(scheduler, runner, dict(PROMPTS))
    for request_id, prompt in PROMPTS.items():
        assert outputs[request_id] == dense_greedy(runner.model, prompt, 10)
    if options.get("max_num_seqs") == 1:
        assert scheduler.kv_cache_manager.stats().prefix_cache_hits >= 16


def test_two_groups_through_the_cpu_kernel():
    # head_dim 16: the C++ kernel's path (it reads the padded pages through the tensors' strides).
    config = dataclasses.replace(CONFIG, head_dim=16, hidden_size=64)
    scheduler, runner = engine_parts(num_blocks=40, model_config=config, attention=TorchAttentionBackend(validate=False),
                                     max_num_batched_tokens=7)
    outputs, _ = run(scheduler, runner, dict(PROMPTS))
    for request_id, prompt in PROMPTS.items():
        assert outputs[request_id] == dense_greedy(runner.model, prompt, 10)


def test_two_groups_under_preemption():
    # 12 blocks: 6 per group, 48 tokens each; three requests of ~30 tokens cannot all stay.
    scheduler, runner = engine_parts(num_blocks=12, max_num_batched_tokens=64, max_model_len=48)
    outputs, steps = run(scheduler, runner, dict(PROMPTS))
    assert any(step.preempted_request_ids for step in steps), "the workload was meant to preempt"
    for request_id, prompt in PROMPTS.items():
        assert outputs[request_id] == dense_greedy(runner.model, prompt, 10)
    assert scheduler.kv_cache_manager.stats().blocks_used == 0


def test_the_layers_specs_come_from_the_layers():
    specs = two_kind_model().kv_cache_specs("float32", 4)
    assert specs == [FullAttentionSpec(2, 8, "float32", 4), FullAttentionSpec(4, 8, "float32", 4)] * 2
