"""How many KV blocks a rank allocates: one count that every rank shares (a block id means the
same slot on every rank), sized from the rank's own device.

    --num-kv-blocks N       N on every rank
    --kv-cache-memory M     M in total: M / N per rank (each holds 1/N of every block's heads)
    neither, CUDA           90% of what this rank's GPU has free after its shard's weights
    neither, CPU            the ranks share the machine's RAM: one budget for all of them
                            (engine/kv_memory.py, counting every rank's weights and runtime),
                            split evenly

Budgets can differ between ranks (another GPU's free memory, MemAvailable moving while peers
load), so every rank takes the minimum; only then is the max_model_len check made, on the
agreed count, so that all ranks pass or fail it together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.engine.kv_memory import default_kv_cache_bytes
from kvserve.engine.model.protocol import CausalLM
from kvserve.engine.model.tensor_parallel import TensorParallel
from kvserve.engine.parallel.process_group import reduce_int
from kvserve.kernels import INT8_KV_DTYPE
from kvserve.paging import KVCacheConfig, KVCacheSpec, MLAAttentionSpec, group_layers, plan_kv_cache_config
from kvserve.paging.kv_cache_spec import blocks_per_request, bytes_per_block


def plan_rank_kv_cache(config: EngineConfig, layer_specs: Sequence[KVCacheSpec], max_model_len: int,
                       weights_bytes: int, parallel: TensorParallel, device: torch.device) -> KVCacheConfig:
    """layer_specs: this rank's layers' (their share of the KV heads); weights_bytes: its weights'.
    Raises KVCacheTooSmallError, naming the longest max_model_len that fits, on every rank alike."""
    groups = group_layers(layer_specs)
    block_bytes = bytes_per_block(groups, config.block_size)
    # A window group holds a window plus one step's tokens, a step being the scheduler's budget.
    step_tokens = config.max_num_batched_tokens
    one_request = block_bytes * blocks_per_request([g.spec for g in groups], max_model_len, config.block_size,
                                                   step_tokens)
    world = parallel.world_size
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // world // block_bytes
    elif device.type == "cuda":
        num_blocks = default_kv_cache_bytes(device, weights_bytes, one_request) // block_bytes
    else:
        all_weights = reduce_int(weights_bytes, dist.ReduceOp.SUM, parallel, device)
        budget = default_kv_cache_bytes(device, all_weights, one_request * world, num_processes=world)
        num_blocks = budget // world // block_bytes
    agreed = reduce_int(num_blocks, dist.ReduceOp.MIN, parallel, device)
    return plan_kv_cache_config(layer_specs, config.block_size, max_model_len, num_kv_blocks=agreed,
                                max_step_tokens=step_tokens)


def layer_kv_specs(model: CausalLM, kv_dtype: torch.dtype) -> list[KVCacheSpec]:
    """One spec per layer of `model` in a cache of `kv_dtype`; a tensor-parallel rank's model
    gives its own share of the KV heads. Latent (MLA) layers refuse int8: their one latent per
    token has no per-head rows to scale."""
    specs = model.kv_cache_specs(str(kv_dtype).removeprefix("torch."), kv_dtype.itemsize)
    if kv_dtype == INT8_KV_DTYPE and any(isinstance(spec, MLAAttentionSpec) for spec in specs):
        raise ConfigError("--kv-cache-dtype", "--kv-cache-dtype int8 is not supported for latent attention (MLA) models "
                                              "such as DeepSeek-V2/V3; use --kv-cache-dtype auto or fp8")
    return specs


def kv_cache_config_for(model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> KVCacheConfig:
    """A cache of `num_blocks` blocks laid out for this model's layers: for runners built
    outside Worker.build (tests, benchmarks)."""
    return KVCacheConfig(num_blocks, block_size, group_layers(layer_kv_specs(model, kv_dtype)))
