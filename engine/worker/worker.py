"""Worker: one rank of the engine, built the same way on every rank (Worker.build).

    join the tensor-parallel group (ranks > 1 of them)
    load the rank's shard: the model is built with the rank's local sizes and each weight read
        as its slice (engine/model/model_loader.py), never the unsharded model
    quantize -> prepack (engine/worker/model_preparation.py) -> size the KV cache, one block count
        for all ranks (engine/worker/kv_cache_sizing.py) -> the runner -> compile (its warm-up)

A single-rank engine is one Worker in the engine process (UniprocExecutor); a tensor-parallel one
is rank 0 there and ranks 1..N-1 in their own processes (MultiprocExecutor), all built by this.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvserve.engine.compilation import compile_at_start_up
from kvserve.engine.config import EngineConfig
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.parallel.process_group import join_group, leave_group, on_every_rank, rank_device
from kvserve.engine.structured_output.token_mask import TokenMask
from kvserve.engine.worker.kv_cache_sizing import layer_kv_specs, plan_rank_kv_cache
from kvserve.engine.worker.model_preparation import prepack, quantize
from kvserve.kernels import FP8_KV_DTYPE, INT8_KV_DTYPE, AttentionBackend, select_attention_backend
from kvserve.paging import KVCacheConfig
from kvserve.scheduler.output import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build itself, picklable (sent to worker processes): the engine
    process has resolved the device, dtype, context length and whether to compile."""

    config: EngineConfig
    source: ModelSource
    device: str  # rank 0's; rank r computes on rank_device(device, r)
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    compiled: bool
    cpu_threads: int  # torch intra-op threads of this rank (on CPU the ranks share the cores)
    rank: int = 0
    world_size: int = 1
    port: int = 0  # rank 0's rendezvous port on 127.0.0.1 (tensor parallelism only)


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype as a tensor type (int8 caches also get their scales: kv_cache_tensors.py)."""
    return {"fp8": FP8_KV_DTYPE, "int8": INT8_KV_DTYPE}.get(config.kv_cache_dtype, dtype)


# An fp8 (e4m3) cache's static per-tensor scales, 1.0 as in vLLM without calibration: SmolLM2's
# keys and values stay far inside e4m3's +-448 range (largest |K| 20, |V| 9.7 over its 30 layers),
# so 1.0 clips nothing. A scale of 1/16, which lifts the first layer's small values out of e4m3's
# subnormals, measured no better (benchmarks/fp8_kv_accuracy.py): the cost is the 3-bit mantissa.
FP8_KV_SCALES = (1.0, 1.0)


def attention_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    """The backend, with the cache's quantisation scales bound in: the forward never knows how
    its cache is stored."""
    return select_attention_backend(config.attention_backend, device,
                                    kv_scales=FP8_KV_SCALES if config.kv_cache_dtype == "fp8" else None)


class Worker:
    def __init__(self, runner: ModelRunner, parallel: TensorParallel) -> None:
        self.runner = runner
        self.parallel = parallel

    @classmethod
    def build(cls, spec: WorkerSpec) -> "Worker":
        torch.set_num_threads(spec.cpu_threads)
        device = rank_device(torch.device(spec.device), spec.rank)
        parallel = SINGLE
        if spec.world_size > 1:
            group = join_group(device, spec.rank, spec.world_size, spec.port)
            parallel = TensorParallel(spec.rank, spec.world_size, group)
        try:
            return cls(_build_runner(spec, device, parallel), parallel)
        except BaseException:
            if parallel.is_sharded:
                leave_group()
            raise

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """This rank's cache: the block count every rank shares, laid out for its share of the heads."""
        return self.runner.kv_cache_config

    def execute(self, output: SchedulerOutput, token_mask: TokenMask | None = None) -> ModelRunnerOutput:
        # Unconstrained steps (nearly all) call the runner with the step alone.
        return self.runner.execute(output) if token_mask is None else self.runner.execute(output, token_mask)

    def close(self) -> None:
        if self.parallel.is_sharded:
            leave_group()


def _build_runner(spec: WorkerSpec, device: torch.device, parallel: TensorParallel) -> ModelRunner:
    config = spec.config
    model_config, model = on_every_rank(parallel, device, lambda: load_model(spec.source, spec.dtype, device, parallel))
    weights_bytes = quantize(model, config.quantization)
    # An explicit --dtype float32 keeps MKL's sgemm, bit-faithful to transformers; `auto` asks for speed.
    weights_bytes += prepack(model, device, weights_bytes, float32=config.dtype == "auto")
    kv_dtype = kv_cache_dtype(config, spec.dtype)
    # From the rank's own layers: they hold its share of the KV heads.
    kv_cache_config = plan_rank_kv_cache(config, layer_kv_specs(model, kv_dtype), spec.max_model_len, weights_bytes,
                                         parallel, device)
    # The compiled forward runs every layer through one graph; a model whose layers differ
    # (DeepSeek's dense and MoE layers) says so (`compiles`) and runs eagerly.
    compiled = spec.compiled and getattr(model, "compiles", True)
    runner = ModelRunner(model, model_config, kv_cache_config, kv_dtype, attention_backend(config, device), device,
                         spec.eos_token_ids, compiled=compiled)
    if compiled:
        compile_at_start_up(functools.partial(runner.warm_up, config.max_num_batched_tokens))
    return runner
