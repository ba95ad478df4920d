"""Tensor parallelism (engine/parallel): the shards compute what the whole layer computes, a
TP=2 engine (gloo, 2 processes) decodes the same greedy tokens as TP=1 in float32, also through
chunked prefill and preemption, a dead worker fails the engine instead of hanging it, and a size
that does not divide the heads is refused before any process starts."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.engine import LLM, AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from kvserve.engine.config import ConfigError
from kvserve.engine.parallel import WorkerDiedError, check_tensor_parallel, rank_model_config
from kvserve.engine.parallel.layers import VocabShard
from kvserve.engine.parallel.sharding import column_shard, row_shard
from kvserve.engine.stats import FinishedRequestStats, StepStats
from tests.server.tiny_checkpoint import write_tiny_checkpoint


class _Preemptions:
    def __init__(self) -> None:
        self.count = 0

    def on_step(self, stats: StepStats) -> None:
        self.count += stats.num_preempted

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        """Only steps matter here."""


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 query heads over 2 KV heads: each of 2 ranks holds 2 query heads and 1 KV head.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gqa"), num_layers=3, hidden=128, heads=4,
                                 kv_heads=2, seed=3)


def test_column_and_row_shards_recompose_the_layer() -> None:
    torch.manual_seed(0)
    sections = (8, 4, 4)  # a fused q, k, v
    full = nn.Linear(6, sum(sections), bias=True)
    x = torch.randn(5, 6)
    world = 2
    outputs = [nn.functional.linear(x, column_shard(full.weight, sections, r, world),
                                    column_shard(full.bias, sections, r, world)) for r in range(world)]
    # Rank r holds [q_r; k_r; v_r]: regroup the sections to compare with the full output.
    expected = full(x).split(list(sections), dim=-1)
    local_sections = [s // world for s in sections]
    for index, whole in enumerate(expected):
        parts = [out.split(local_sections, dim=-1)[index] for out in outputs]
        torch.testing.assert_close(torch.cat(parts, dim=-1), whole)
    down = nn.Linear(8, 3, bias=False)
    h = torch.randn(5, 8)
    partials = [nn.functional.linear(h.chunk(world, dim=-1)[r], row_shard(down.weight, r, world)) for r in range(world)]
    torch.testing.assert_close(sum(partials), down(h))


def test_vocab_shards_are_padded_to_equal_sizes_with_rows_no_token_reaches() -> None:
    table = torch.arange(10.0).reshape(5, 2)  # vocab 5 over 2 ranks: 3 rows each, the last one padding
    first, second = VocabShard(table, 0, 2), VocabShard(table, 1, 2)
    assert (first.start, second.start) == (0, 3)
    torch.testing.assert_close(first.rows, table[:3])
    torch.testing.assert_close(second.rows, torch.cat([table[3:], torch.zeros(1, 2)]))


def test_sizes_that_do_not_divide_the_heads_are_refused(tiny_gqa: Path) -> None:
    from kvserve.engine.model.registry import load_model_config

    config = load_model_config(tiny_gqa)
    assert rank_model_config(config, 2).num_kv_heads == 1
    with pytest.raises(ConfigError, match="does not divide the model's 2 KV heads") as error:
        check_tensor_parallel(dataclasses.replace(config, num_heads=8), 4)
    assert error.value.option == "--tensor-parallel-size"
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        LLMEngine.from_config(EngineConfig(model=str(tiny_gqa), dtype="float32", num_kv_blocks=64,
                                           tensor_parallel_size=3))


def _greedy(path: Path, tensor_parallel_size: int, prompts: list[list[int]], max_tokens: int,
            **engine_args: int) -> tuple[list[list[int]], int]:
    preemptions = _Preemptions()
    config = EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=tensor_parallel_size, **engine_args)
    engine = LLMEngine.from_config(config, [preemptions])
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.outputs[0].token_ids)
    finally:
        engine.close()
    return [tokens[str(i)] for i in range(len(prompts))], preemptions.count


@pytest.mark.slow
def test_tp2_decodes_the_same_greedy_tokens_through_chunked_prefill_and_preemption(tiny_gqa: Path) -> None:
    prompts = [[(7 * i + 13 * j) % 200 + 3 for j in range(40 + 9 * i)] for i in range(4)]
    # 64-token budget: the long prompts are prefilled in chunks. 16 blocks of 16 tokens cannot hold
    # 4 x (up to 67 + 32) tokens: the newest requests are preempted and recomputed.
    engine_args = dict(max_num_batched_tokens=64, num_kv_blocks=16, block_size=16, max_model_len=128)
    reference, reference_preemptions = _greedy(tiny_gqa, 1, prompts, 32, **engine_args)
    sharded, preemptions = _greedy(tiny_gqa, 2, prompts, 32, **engine_args)
    assert reference_preemptions > 0 and preemptions > 0
    assert len({tuple(t) for t in reference}) > 1 and all(len(set(t)) > 1 for t in reference)  # not degenerate
    assert sharded == reference


@pytest.mark.slow
def test_a_dead_worker_fails_the_engine_instead_of_hanging_it(tiny_gqa: Path) -> None:
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_gqa), dtype="float32", num_kv_blocks=64,
                                                  tensor_parallel_size=2))
    engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=4)

        async def generate(request_id: str) -> None:
            async for _ in engine.generate([5, 6, 7, 8], params, request_id):
                pass

        asyncio.run(asyncio.wait_for(generate("before"), timeout=60))
        worker = engine.engine.model_runner.workers.processes[0]
        worker.kill()
        worker.join(10)
        with pytest.raises(Exception) as raised:
            asyncio.run(asyncio.wait_for(generate("after"), timeout=60))
        assert not isinstance(raised.value, asyncio.TimeoutError)
        assert engine.is_dead
        assert isinstance(engine.dead_error, WorkerDiedError)
    finally:
        engine.shutdown()
    assert not worker.is_alive()


@pytest.mark.slow
def test_default_model_tp3_decodes_the_same_greedy_tokens() -> None:
    """SmolLM2-135M has 9 query and 3 KV heads: 3 ranks of 3 and 1."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = []
    for size in (1, 3):
        with LLM(dtype="float32", num_kv_blocks=128, max_model_len=512, tensor_parallel_size=size) as llm:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[1] == results[0]
