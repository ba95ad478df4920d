"""Builds an engine's parts from an EngineConfig: tokenizer, scheduler, and the executor whose
workers load the model and allocate the KV cache (engine/worker).

This is where the I/O happens (reading metadata, spawning ranks), so that the config stays plain
data and LLMEngine's constructor stays a constructor. Everything that can be refused from the
model's metadata (context length, tensor-parallel size) is checked here, before any weight loads
or worker process starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.engine.cpu_caches import limit_cpu_caches
from kvserve.engine.cpu_threads import apply_cpu_threads
from kvserve.engine.device import resolve_device, resolve_dtype
from kvserve.engine.executor import Executor, executor_for
from kvserve.engine.model.model_config import ModelConfig, end_of_generation_ids
from kvserve.engine.model.model_source import ModelSource, resolve_model
from kvserve.engine.model.registry import load_model_config
from kvserve.engine.model.tensor_parallel import check_tensor_parallel
from kvserve.engine.step_tokens import default_max_num_batched_tokens
from kvserve.engine.text.tokenizer import Tokenizer
from kvserve.engine.worker import WorkerSpec
from kvserve.kernels.cpu_bf16_gemm import bf16_matrix_tiles
from kvserve.kernels.cpu_kernel_build import cpp_toolchain_problem
from kvserve.paging import KVCacheManager
from kvserve.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    config: EngineConfig  # the one given, with its device-dependent defaults filled in
    model_config: ModelConfig
    tokenizer: Tokenizer
    scheduler: Scheduler
    executor: Executor


def build_engine_parts(config: EngineConfig) -> EngineParts:
    limit_cpu_caches()  # before any matmul: oneDNN and ideep read their caps once
    threads = apply_cpu_threads(config.cpu_threads)
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    if config.max_num_batched_tokens is None:
        matrix_tiles = device.type == "cpu" and dtype == torch.bfloat16 and bf16_matrix_tiles()
        config = replace(config, max_num_batched_tokens=default_max_num_batched_tokens(
            device.type, threads, config.max_num_seqs, matrix_tiles=matrix_tiles))
    if config.quantization is not None and device.type != "cpu":
        raise ConfigError("--quantization", f"--quantization {config.quantization} uses torch's CPU weight-only "
                                            f"kernels; it is not available on {device}")
    source = resolve_model(config.model)
    model_config = load_model_config(source.path)
    check_tensor_parallel(model_config, config.tensor_parallel_size)  # before sizing or spawning anything
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(
            "--max-model-len",
            f"--max-model-len {max_model_len} exceeds the model's context length "
            f"{model_config.max_position_embeddings}",
        )
    tokenizer = Tokenizer.from_gguf(source.path) if source.format == "gguf" else Tokenizer.from_hf_dir(source.path)
    executor = executor_for(worker_spec(config, source, device, dtype, max_model_len,
                                        end_of_generation_ids(model_config, tokenizer.eos_token_id), threads))
    kv_cache_config = executor.driver.kv_cache_config
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=config.scheduling_policy,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        ),
        KVCacheManager.from_config(kv_cache_config, config.enable_prefix_caching),
    )
    runner = executor.driver.runner
    logger.info(
        "model %s (%s) on %s in %s%s%s; KV cache (%s): %d blocks of %d tokens, %.2f GiB; attention: %s; "
        "%d CPU threads; %s forward; steps of up to %d tokens",
        config.model, model_config.architecture, device, str(dtype).removeprefix("torch."),
        f" with {config.quantization} weights" if config.quantization else "",
        f", {config.tensor_parallel_size} tensor-parallel ranks" if config.tensor_parallel_size > 1 else "",
        kv_cache_config.groups[0].spec.dtype, kv_cache_config.num_blocks, kv_cache_config.block_size,
        kv_cache_config.total_bytes * config.tensor_parallel_size / 2**30, runner.attention.name, threads,
        "compiled" if runner.compiled else "eager", config.max_num_batched_tokens,
    )
    return EngineParts(config, model_config, tokenizer, scheduler, executor)


def worker_spec(config: EngineConfig, source: ModelSource, device: torch.device, dtype: torch.dtype,
                max_model_len: int, eos_token_ids: tuple[int, ...], threads: int) -> WorkerSpec:
    """Rank 0's spec; the executor derives the other ranks' from it."""
    # Compiled on CPU unless --enforce-eager; on CUDA the compiled path is not verified yet, so it
    # runs eagerly. Inductor's CPU code is C++: where no compiler or no headers are installed (a
    # slim image, one that strips torch's headers) the forward runs eagerly rather than failing at
    # start-up.
    compiled = not config.enforce_eager and device.type == "cpu"
    toolchain_problem = cpp_toolchain_problem(python_headers=True) if compiled else None
    if toolchain_problem is not None:
        logger.warning("%s: running the forward eagerly; install a C++ compiler (g++) with torch's and Python's "
                       "headers to compile it, or pass --enforce-eager to silence this", toolchain_problem)
        compiled = False
    world = config.tensor_parallel_size
    # On CPU the ranks share the cores the engine was given: each takes its share of threads.
    rank_threads = max(1, threads // world) if device.type == "cpu" else threads
    return WorkerSpec(config, source, str(device), dtype, max_model_len, eos_token_ids, compiled, rank_threads,
                      rank=0, world_size=world)
