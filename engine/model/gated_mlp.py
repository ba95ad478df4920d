"""The gated MLP of Llama-style decoders: down(act(gate(x)) * up(x)), gate and up fused into one
matmul (fewer, larger GEMMs), column-parallel in, row-parallel out under tensor parallelism."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.model.parallel_layers import column_parallel_linear, row_parallel_linear
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, parallel: TensorParallel = SINGLE,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.intermediate_size = parallel.local(intermediate_size)
        self.activation = activation
        self.gate_up_proj = column_parallel_linear(hidden_size, (intermediate_size,) * 2, False, parallel)
        self.down_proj = row_parallel_linear(intermediate_size, hidden_size, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.activation(gate) * up)
