"""Which slice of each weight a rank keeps (Megatron-style), and the per-rank model shape.

    column-parallel (qkv_proj, gate_up_proj): output features split; each fused section (q, k, v;
        gate, up) is split separately so each rank's slice is [q_r; k_r; v_r], whole heads only.
    row-parallel (o_proj, down_proj): input features split; partial outputs are summed by all_reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.model.tensor_parallel import check_tensor_parallel, rank_model_config, valid_sizes

__all__ = ["check_tensor_parallel", "column_shard", "rank_model_config", "row_shard", "valid_sizes"]


def column_shard(weight: torch.Tensor, sections: Sequence[int], rank: int, world_size: int) -> torch.Tensor:
    """Rows of a fused [sum(sections), ...] weight (or bias) that `rank` computes."""
    parts = weight.split(list(sections), dim=0)
    return torch.cat([part.chunk(world_size, dim=0)[rank] for part in parts], dim=0).contiguous()


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Input columns of a [out, in] weight that `rank` multiplies with its activations."""
    return weight.chunk(world_size, dim=1)[rank].contiguous()
