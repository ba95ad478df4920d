"""Which rank of how many a model is built for, and whether a model's shape can be split that way.

A model is built with its rank's local sizes (engine/model/parallel_layers.py): each rank holds
1/N of every attention head group, MLP column and vocabulary row. The default, one rank of one,
builds the plain single-device model. The process group is the rank's own (torch.distributed);
this module never creates one (engine/parallel does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from kvserve.engine.config import ConfigError
from kvserve.engine.model.model_config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # None only for a single rank

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.world_size}")
        if self.world_size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs its process group")

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1

    def local(self, size: int) -> int:
        """This rank's share of `size` features (callers checked divisibility: check_tensor_parallel)."""
        if size % self.world_size:
            raise ValueError(f"{size} does not split evenly over {self.world_size} ranks")
        return size // self.world_size

    def range_of(self, size: int) -> tuple[int, int]:
        """[start, stop) of this rank's even share of `size`."""
        local = self.local(size)
        return self.rank * local, (self.rank + 1) * local

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, stop) of this rank's vocabulary rows: ceil(vocab / N) each, so every rank holds
        the same count; the last rank's range may run past the vocabulary (zero padding rows)."""
        per_rank = -(-vocab_size // self.world_size)
        return self.rank * per_rank, (self.rank + 1) * per_rank


SINGLE = TensorParallel()


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

