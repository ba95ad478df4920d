"""Column- and row-parallel linear layers, and the conversion of a loaded Llama model to one rank.

The model code (engine/model/llama.py) stays single-device: a rank's model is the loaded model
with each projection replaced by its shard and each attention/MLP told its local head and
column counts. Embeddings, norms and lm_head stay whole on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.parallel.sharding import column_shard, rank_model_config, row_shard


class ColumnParallelLinear(nn.Module):
    """This rank's output features of a linear layer; no communication."""

    def __init__(self, full: nn.Linear, sections: Sequence[int], rank: int, world_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(column_shard(full.weight.data, sections, rank, world_size), requires_grad=False)
        self.bias = (nn.Parameter(column_shard(full.bias.data, sections, rank, world_size), requires_grad=False)
                     if full.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input features of a linear layer; the partial products of all ranks are summed
    (all_reduce), so every rank ends with the full output."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        if full.bias is not None:
            raise ValueError("row-parallel layers with a bias are not supported (the Llama family has none)")
        self.weight = nn.Parameter(row_shard(full.weight.data, rank, world_size), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out


def shard_model(model: LlamaForCausalLM, config: ModelConfig, rank: int, world_size: int,
                group: dist.ProcessGroup) -> LlamaForCausalLM:
    """Converts `model` (full weights, loaded) in place to rank `rank` of `world_size`."""
    local = rank_model_config(config, world_size)
    for layer in model.layers:
        attn = layer.self_attn
        attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, (config.q_size, config.kv_size, config.kv_size),
                                             rank, world_size)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world_size, group)
        attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
        attn.q_size, attn.kv_size = local.q_size, local.kv_size
        mlp = layer.mlp
        mlp.gate_up_proj = ColumnParallelLinear(mlp.gate_up_proj, (config.intermediate_size,) * 2, rank, world_size)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world_size, group)
        mlp.intermediate_size = local.intermediate_size
    return model
