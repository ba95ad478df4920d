"""Builds an engine's parts from an EngineConfig: model, tokenizer, KV cache, scheduler, runner.

This is where the I/O happens (reading weights, sizing memory), so that the config stays plain
data and LLMEngine's constructor stays a constructor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.engine.compilation import compile_at_start_up
from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.engine.cpu_caches import limit_cpu_caches
from kvserve.engine.cpu_threads import apply_cpu_threads
from kvserve.engine.device import resolve_device, resolve_dtype
from kvserve.engine.kv_memory import default_kv_cache_bytes
from kvserve.engine.model.model_config import ModelConfig, end_of_generation_ids
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.model.model_source import resolve_model
from kvserve.engine.model.packed_linear import pack_linear_weights
from kvserve.engine.quantization import quantize_model
from kvserve.engine.text.tokenizer import Tokenizer
from kvserve.kernels import FP8_KV_DTYPE, AttentionBackend, select_attention_backend
from kvserve.kernels.cpu_kernel_build import cpp_toolchain_problem
from kvserve.paging import KVCacheConfig, KVCacheManager, group_layers, plan_kv_cache_config
from kvserve.paging.kv_cache_spec import bytes_per_block
from kvserve.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    model_config: ModelConfig
    tokenizer: Tokenizer
    scheduler: Scheduler
    model_runner: ModelRunner


def build_engine_parts(config: EngineConfig) -> EngineParts:
    limit_cpu_caches()  # before any matmul: oneDNN and ideep read their caps once
    threads = apply_cpu_threads(config.cpu_threads)
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    if config.quantization is not None and device.type != "cpu":
        raise ConfigError("--quantization", f"--quantization {config.quantization} uses torch's CPU weight-only "
                                            f"kernels; it is not available on {device}")
    source = resolve_model(config.model)
    model_config, model = load_model(source, dtype, device)
    if config.quantization is not None:  # before the runner (and any compilation) sees the model
        quantize_model(model, config.quantization)
    if config.tensor_parallel_size > 1:
        # Imported here: worker processes import this module, and only TP needs the parallel package.
        from kvserve.engine.parallel import TensorParallelRunner, check_tensor_parallel

        check_tensor_parallel(model_config, config.tensor_parallel_size)  # before sizing or spawning anything
    tokenizer = Tokenizer.from_gguf(source.path) if source.format == "gguf" else Tokenizer.from_hf_dir(source.path)

    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(
            "--max-model-len",
            f"--max-model-len {max_model_len} exceeds the model's context length "
            f"{model_config.max_position_embeddings}",
        )
    kv_dtype = kv_cache_dtype(config, dtype)
    layer_specs = model.kv_cache_specs(str(kv_dtype).removeprefix("torch."), kv_dtype.itemsize)
    kv_cache_memory = config.kv_cache_memory
    if config.num_kv_blocks is None and kv_cache_memory is None:
        weights_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        one_request = bytes_per_block(group_layers(layer_specs), config.block_size) * -(-max_model_len // config.block_size)
        kv_cache_memory = default_kv_cache_bytes(device, weights_bytes, one_request)
    kv_cache_config = plan_kv_cache_config(layer_specs, config.block_size, max_model_len,
                                           num_kv_blocks=config.num_kv_blocks, kv_cache_memory=kv_cache_memory)
    num_blocks = kv_cache_config.num_blocks

    attention = attention_backend(config, device)
    eos_token_ids = end_of_generation_ids(model_config, tokenizer.eos_token_id)
    # Compiled on CPU unless --enforce-eager; on CUDA and in tensor-parallel workers the compiled
    # path is not verified yet, so they run eagerly. Inductor's CPU code is C++: where no compiler
    # or no headers are installed (a slim image, one that strips torch's headers) the forward runs
    # eagerly rather than failing at start-up.
    compiled = not config.enforce_eager and device.type == "cpu" and config.tensor_parallel_size == 1
    toolchain_problem = cpp_toolchain_problem(python_headers=True) if compiled else None
    if toolchain_problem is not None:
        logger.warning("%s: running the forward eagerly; install a C++ compiler (g++) with torch's and Python's "
                       "headers to compile it, or pass --enforce-eager to silence this", toolchain_problem)
        compiled = False
    if device.type == "cpu" and config.tensor_parallel_size == 1:
        # After quantization (which swaps the layers it converts) and after the KV sizing above
        # (which counts the dense weights the packed ones replace), before any compiling.
        packed = pack_linear_weights(model)
        logger.info("%d linear layers' weights prepacked for oneDNN", packed)
    if config.tensor_parallel_size > 1:
        runner: ModelRunner = TensorParallelRunner.start(config, source, model, model_config, num_blocks, kv_dtype,
                                                         attention, device, dtype, eos_token_ids)
    else:
        runner = ModelRunner(model, model_config, kv_cache_config, kv_dtype, attention, device, eos_token_ids,
                             compiled=compiled)
        if compiled:
            compile_at_start_up(runner.warm_up)
    kv_manager = KVCacheManager.from_config(runner.kv_cache_config, config.enable_prefix_caching)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=config.scheduling_policy,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        ),
        kv_manager,
    )
    logger.info(
        "model %s (%s) on %s in %s%s; KV cache (%s): %d blocks of %d tokens, %.2f GiB; attention: %s; %d CPU threads; %s forward",
        config.model, model_config.architecture, device, str(dtype).removeprefix("torch."),
        f" with {config.quantization} weights" if config.quantization else "", str(kv_dtype).removeprefix("torch."),
        num_blocks, config.block_size, kv_cache_config.total_bytes / 2**30, attention.name, threads,
        "compiled" if compiled else "eager",
    )
    return EngineParts(model_config, tokenizer, scheduler, runner)


def kv_cache_config_for(model: torch.nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> KVCacheConfig:
    """A cache of `num_blocks` blocks laid out for this model's layers (a tensor-parallel rank's
    model gives its own share of the heads; every rank has the same block count)."""
    specs = model.kv_cache_specs(str(kv_dtype).removeprefix("torch."), kv_dtype.itemsize)
    return KVCacheConfig(num_blocks, block_size, group_layers(specs))


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    return FP8_KV_DTYPE if config.kv_cache_dtype == "fp8" else dtype


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
