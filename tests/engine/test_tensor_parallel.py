"""Tensor parallelism (engine/executor, engine/parallel): a TP=2 engine (gloo, 2 processes)
decodes the same greedy tokens as TP=1 in float32, also through chunked prefill and preemption,
compiled, and with int8/int4 weights; a dead worker fails the engine instead of hanging it, and
a size that does not divide the heads is refused before any process starts. (What each rank
loads: tests/engine/test_sharded_loading.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np

import pytest
import torch

from kvserve.engine import LLM, AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from kvserve.engine.config import ConfigError
from kvserve.engine.executor import MultiprocExecutor
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.parallel import WorkerDiedError, check_tensor_parallel
from kvserve.engine.parallel.process_group import COLLECTIVE_TIMEOUT
from kvserve.engine.quantization.quantize_model import KERNEL_ENV
from kvserve.engine.worker import WorkerSpec
from kvserve.engine.stats import FinishedRequestStats, StepStats
from tests.engine.test_model_gguf import hf_weights, write_gguf
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


def test_sizes_that_do_not_divide_the_heads_are_refused(tiny_gqa: Path) -> None:
    from kvserve.engine.model.registry import load_model_config

    config = load_model_config(tiny_gqa)
    check_tensor_parallel(config, 2)  # 2 query heads and 1 KV head per rank
    with pytest.raises(ConfigError, match="does not divide the model's 2 KV heads") as error:
        check_tensor_parallel(dataclasses.replace(config, num_heads=8), 4)
    assert error.value.option == "--tensor-parallel-size"
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        LLMEngine.from_config(EngineConfig(model=str(tiny_gqa), dtype="float32", num_kv_blocks=64,
                                           tensor_parallel_size=3))


@dataclasses.dataclass
class Greedy:
    tokens: list[list[int]]
    logprobs: list[list[float]]  # of each chosen token
    preemptions: int


def _greedy(path: Path, tensor_parallel_size: int, prompts: list[list[int]], max_tokens: int,
            **engine_args: object) -> Greedy:
    preemptions = _Preemptions()
    engine_args = {"enforce_eager": True, **engine_args}
    config = EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=tensor_parallel_size, **engine_args)
    engine = LLMEngine.from_config(config, [preemptions])
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.outputs[0].token_ids)
                logprobs[delta.request_id].extend(t.logprob for t in delta.outputs[0].logprobs or [])
        runner = engine.executor.driver.runner
        assert runner.compiled == (not engine_args["enforce_eager"])
        assert runner.graphs_bound == runner.compiled  # the layers run their compiled graphs directly
    finally:
        engine.close()
    ids = [str(i) for i in range(len(prompts))]
    return Greedy([tokens[i] for i in ids], [logprobs[i] for i in ids], preemptions.count)


def _not_degenerate(result: Greedy) -> bool:
    return len({tuple(t) for t in result.tokens}) > 1 and all(len(set(t)) > 1 for t in result.tokens)


def _assert_close(sharded: Greedy, reference: Greedy, tolerance: float) -> None:
    assert sharded.tokens == reference.tokens
    worst = max(abs(a - b) for got, want in zip(sharded.logprobs, reference.logprobs, strict=True)
                for a, b in zip(got, want, strict=True))
    assert worst <= tolerance, f"max |logprob difference| {worst:.2e}"


PROMPTS = [[(7 * i + 13 * j) % 200 + 3 for j in range(40 + 9 * i)] for i in range(4)]
# 64-token budget: the long prompts are prefilled in chunks. 16 blocks of 16 tokens cannot hold
# 4 x (up to 67 + 32) tokens: the newest requests are preempted and recomputed.
CHUNKED_AND_PREEMPTED = dict(max_num_batched_tokens=64, num_kv_blocks=16, block_size=16, max_model_len=128)
# Shards sum their partial products in another order than one matmul does: float32 rounding
# (~1e-6 relative) is all that may differ.
FLOAT32_TOLERANCE = 1e-4


@pytest.mark.slow
def test_tp2_decodes_the_same_greedy_tokens_through_chunked_prefill_and_preemption(tiny_gqa: Path) -> None:
    reference = _greedy(tiny_gqa, 1, PROMPTS, 32, **CHUNKED_AND_PREEMPTED)
    sharded = _greedy(tiny_gqa, 2, PROMPTS, 32, **CHUNKED_AND_PREEMPTED)
    assert reference.preemptions > 0 and sharded.preemptions > 0
    assert _not_degenerate(reference)
    _assert_close(sharded, reference, FLOAT32_TOLERANCE)


@pytest.mark.slow
def test_tp2_compiled_equals_tp1_compiled(tiny_gqa: Path) -> None:
    """Every rank compiles its layers (the row-parallel all_reduce inside the graph)."""
    prompts = PROMPTS[:2]
    engine_args = dict(num_kv_blocks=64, max_model_len=128, enforce_eager=False)
    reference = _greedy(tiny_gqa, 1, prompts, 16, **engine_args)
    assert _not_degenerate(reference)
    torch._dynamo.utils.counters.clear()
    sharded = _greedy(tiny_gqa, 2, prompts, 16, **engine_args)
    # Rank 0 compiled in this process: dynamo traced torch.distributed's all_reduce as a functional
    # collective, inside the layer's graph, without breaking it.
    assert not torch._dynamo.utils.counters["graph_break"]
    _assert_close(sharded, reference, FLOAT32_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tp2_quantized_equals_tp1_quantized(tiny_gqa: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank quantizes its shard to the same int8/int4 values as the unsharded layer's slice
    (int8 row-parallel scales agreed over the ranks, int4 groups inside a rank's slice), so the
    float32 tolerance holds, not a quantization-sized one. On torch's ops: the VNNI kernels also
    round activations to int8, where a float32-sized difference can flip one rounding and so,
    later, a near-tied greedy token."""
    monkeypatch.setenv(KERNEL_ENV, "torch")  # the workers' environment too
    engine_args = dict(num_kv_blocks=64, max_model_len=128, quantization=mode)
    reference = _greedy(tiny_gqa, 1, PROMPTS, 16, **engine_args)
    assert _not_degenerate(reference)
    _assert_close(_greedy(tiny_gqa, 2, PROMPTS, 16, **engine_args), reference, FLOAT32_TOLERANCE)


@pytest.mark.slow
def test_what_rank_0_sends_a_worker_per_step_does_not_grow_with_the_output(tiny_gqa: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes each step puts on a worker's pipe (the pickled SchedulerOutput, as Connection.send
    pickles it): a decode step at output token 500 costs what one at token 10 does."""
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_gqa), dtype="float32", num_kv_blocks=64,
                                                max_model_len=512, tensor_parallel_size=2, enforce_eager=True))
    try:
        workers = engine.executor.workers
        send, sizes = workers.send, []

        def measured(output):
            sizes.append(len(ForkingPickler.dumps(output)))
            send(output)

        monkeypatch.setattr(workers, "send", measured)
        engine.add_request("a", list(range(3, 13)), SamplingParams(temperature=0, max_tokens=501, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()
    # Step 1 prefills the 10-token prompt (and carries it); step n > 1 computes position 8 + n:
    # neither step 10 nor step 500 starts a block (16 tokens), so neither carries a block id.
    print(f"bytes sent to a worker: step 1 {sizes[0]}, step 10 {sizes[9]}, step 500 {sizes[499]}")
    assert sizes[0] > sizes[9]
    # A few bytes of integers that grew (positions, token ids) at most.
    assert abs(sizes[499] - sizes[9]) <= 8, (sizes[9], sizes[499])


@pytest.mark.slow
def test_a_rank_that_cannot_load_its_slice_fails_the_start_with_its_own_error(tmp_path: Path) -> None:
    """Only rank 1's rows of one weight are damaged: rank 0 loads its slice, learns that a peer
    failed (instead of waiting in its next collective) and reports the worker's own error."""
    weights = hf_weights()
    weights["model.layers.1.mlp.up_proj.weight"][-1, 0] = np.nan  # the last row: rank 1's half
    path = tmp_path / "damaged.gguf"
    write_gguf(path, weights)
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, enforce_eager=True,
                          tensor_parallel_size=2)
    spec = WorkerSpec(config, ModelSource("gguf", path), "cpu", torch.float32, max_model_len=64, eos_token_ids=(),
                      compiled=False, cpu_threads=1, world_size=2)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker 1 failed to start(.|\n)*blk\.1\.ffn_up\.weight.*NaN"):
        MultiprocExecutor(spec)
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT.total_seconds()


@pytest.mark.slow
def test_a_dead_worker_fails_the_engine_instead_of_hanging_it(tiny_gqa: Path) -> None:
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_gqa), dtype="float32", num_kv_blocks=64,
                                                  tensor_parallel_size=2, enforce_eager=True))
    engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=4)

        async def generate(request_id: str) -> None:
            async for _ in engine.generate([5, 6, 7, 8], params, request_id):
                pass

        asyncio.run(asyncio.wait_for(generate("before"), timeout=60))
        worker = engine.engine.executor.processes[0]
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
        with LLM(dtype="float32", num_kv_blocks=128, max_model_len=512, tensor_parallel_size=size,
                 enforce_eager=True) as llm:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[1] == results[0]
