"""Column- and row-parallel linear layers, and the conversion of a loaded Llama model to one rank.

The model code (engine/model/llama.py) stays single-device: a rank's model is the loaded model
with each projection replaced by its shard and each attention/MLP told its local head and
column counts. The vocabulary is split too: each rank embeds the token ids in its range (the
others contribute zeros to an all_reduce) and computes its range of the logits (all_gather).
The vocabulary is padded to a multiple of N with zero rows, which no token id reaches and whose
logits are cut off. Norms stay whole on every rank.
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


class VocabShard:
    """Rows [start, end) of a [vocab, hidden] table, padded so every rank has the same count."""

    def __init__(self, table: torch.Tensor, rank: int, world_size: int) -> None:
        per_rank = -(-table.shape[0] // world_size)
        self.start = rank * per_rank
        rows = table[self.start:self.start + per_rank]
        padding = per_rank - rows.shape[0]
        self.rows = torch.cat([rows, rows.new_zeros(padding, table.shape[1])]) if padding else rows.clone()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, shard: VocabShard, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(shard.rows, requires_grad=False)
        self.start = shard.start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelLMHead(nn.Module):
    """This rank's range of the logits; every rank ends with all of them (all_gather)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, world_size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = weight  # the embedding's shard when the model ties them
        self.vocab_size, self.world_size, self.group = vocab_size, world_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def shard_model(model: LlamaForCausalLM, config: ModelConfig, rank: int, world_size: int,
                group: dist.ProcessGroup) -> LlamaForCausalLM:
    """Converts `model` (full weights, loaded) in place to rank `rank` of `world_size`."""
    local = rank_model_config(config, world_size)
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(VocabShard(model.embed_tokens.weight.data, rank, world_size), group)
    head = model.embed_tokens.weight if tied else nn.Parameter(
        VocabShard(model.lm_head.weight.data, rank, world_size).rows, requires_grad=False)
    model.lm_head = VocabParallelLMHead(head, config.vocab_size, world_size, group)
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
