"""Which slice of each weight a rank keeps (Megatron-style), and the per-rank model shape.

    column-parallel (qkv_proj, gate_up_proj): output features split; each fused section (q, k, v;
        gate, up) is split separately so each rank's slice is [q_r; k_r; v_r], whole heads only.
    row-parallel (o_proj, down_proj): input features split; partial outputs are summed by all_reduce.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from kvserve.engine.config import ConfigError
from kvserve.engine.model.model_config import ModelConfig


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Every rank must hold whole query heads and whole KV heads, with the same GQA grouping."""
    for what, count in (("attention heads", config.num_heads), ("KV heads", config.num_kv_heads),
                        ("MLP intermediate size", config.intermediate_size)):
        if count % world_size:
            raise ConfigError("--tensor-parallel-size",
                              f"--tensor-parallel-size {world_size} does not divide the model's {count} {what}; "
                              f"sizes that fit this model: {', '.join(map(str, valid_sizes(config)))}")


def valid_sizes(config: ModelConfig) -> list[int]:
    common = math.gcd(config.num_heads, config.num_kv_heads, config.intermediate_size)
    return [n for n in range(1, common + 1) if common % n == 0]


def rank_model_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shape one rank computes: its share of the heads and of the MLP. The KV cache of a rank
    is allocated from it ([blocks, num_kv_heads / N, block_size, head_dim])."""
    check_tensor_parallel(config, world_size)
    return dataclasses.replace(config, num_heads=config.num_heads // world_size,
                               num_kv_heads=config.num_kv_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size)


def column_shard(weight: torch.Tensor, sections: Sequence[int], rank: int, world_size: int) -> torch.Tensor:
    """Rows of a fused [sum(sections), ...] weight (or bias) that `rank` computes."""
    parts = weight.split(list(sections), dim=0)
    return torch.cat([part.chunk(world_size, dim=0)[rank] for part in parts], dim=0).contiguous()


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Input columns of a [out, in] weight that `rank` multiplies with its activations."""
    return weight.chunk(world_size, dim=1)[rank].contiguous()
