"""Layers built with one tensor-parallel rank's local sizes (Megatron-style), or plain ones for a
single rank.

    column-parallel (qkv_proj, gate_up_proj): a plain nn.Linear with this rank's output features;
        each fused section (q, k, v; gate, up) is split separately, so a rank's rows are
        [q_r; k_r; v_r], whole heads only. No communication.
    row-parallel (o_proj, down_proj): this rank's input features; the partial products of all
        ranks are summed (all_reduce), so every rank ends with the full output.
    vocabulary-parallel embedding and lm_head: ceil(vocab / N) rows per rank, zero-padded; a rank
        embeds the token ids in its range (the others add zeros: all_reduce) and computes its
        range of the logits (all_gather, padding cut off).

The row-parallel and lm_head layers wrap an inner `nn.Linear` (`.linear`) and add the collective
around it. Passes that swap linear layers (quantization, weight prepacking) swap the inner one
and keep the collective; a checkpoint's weight loads into the inner layer under the wrapper's
name (`o_proj.weight`), so checkpoints and layouts never see the wrapping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvserve.engine.model.tensor_parallel import TensorParallel


class ParallelWrapper(nn.Module):
    """A layer whose weights live in an inner nn.Linear, `linear`, and whose forward adds a collective."""

    linear: nn.Module


def column_parallel_linear(in_features: int, sections: Sequence[int], bias: bool, parallel: TensorParallel) -> nn.Linear:
    """A fused linear of `sections` output features (q, k, v), this rank's share of each."""
    return nn.Linear(in_features, sum(parallel.local(s) for s in sections), bias=bias)


class RowParallelLinear(ParallelWrapper):
    def __init__(self, linear: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out

    def reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `values` over the ranks (in place): e.g. an output channel's
        largest weight over all input features, so a per-channel quantization scale is the one
        the unsharded layer would get."""
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values


def row_parallel_linear(in_features: int, out_features: int, parallel: TensorParallel) -> nn.Module:
    """No bias: the Llama family has none there, and a sharded one would be added N times."""
    if not parallel.is_sharded:
        return nn.Linear(in_features, out_features, bias=False)
    return RowParallelLinear(nn.Linear(parallel.local(in_features), out_features, bias=False), parallel.group)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.start, stop = parallel.vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(stop - self.start, hidden_size))
        self.group = parallel.group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


def vocab_embedding(vocab_size: int, hidden_size: int, parallel: TensorParallel) -> nn.Module:
    if not parallel.is_sharded:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, parallel)


class ParallelLMHead(ParallelWrapper):
    """This rank's range of the logits; every rank ends with all of them (all_gather)."""

    def __init__(self, linear: nn.Module, vocab_size: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.linear = linear
        self.vocab_size, self.world_size, self.group = vocab_size, parallel.world_size, parallel.group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.linear(hidden).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def lm_head(hidden_size: int, vocab_size: int, parallel: TensorParallel, tied_to: nn.Module | None) -> nn.Module:
    """The output layer; `tied_to`: the embedding whose weight it shares (each rank its own rows)."""
    start, stop = parallel.vocab_range(vocab_size)
    linear = nn.Linear(hidden_size, stop - start, bias=False)
    if tied_to is not None:
        linear.weight = tied_to.weight
    return ParallelLMHead(linear, vocab_size, parallel) if parallel.is_sharded else linear
