"""SmolLM2-135M's weight shapes and torch's bf16 matmul timings on them (ceiling.py, quant_accuracy.py).

A decode step runs, per layer, the fused qkv, o, gate_up and down projections over every row of
the batch, and lm_head over the rows that sample (one per request that produces a token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.engine.model.packed_linear import packed_linear

NUM_LAYERS = 30


@dataclass(frozen=True)
class WeightShape:
    name: str
    out_features: int
    in_features: int
    per_forward: int  # how many such matrices one forward reads


LAYER_SHAPES = (WeightShape("qkv", 960, 576, NUM_LAYERS), WeightShape("o", 576, 576, NUM_LAYERS),
                WeightShape("gate_up", 3072, 576, NUM_LAYERS), WeightShape("down", 576, 1536, NUM_LAYERS))
LM_HEAD = WeightShape("lm_head", 49152, 576, 1)
ALL_SHAPES = (*LAYER_SHAPES, LM_HEAD)


def _matmul(weight: torch.Tensor, packed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x W^T: torch's F.linear on the row-major weight, or (packed) the oneDNN-prepacked
    weight that kvserve's CPU bf16 layers use (engine/model/packed_linear.py)."""
    if not packed:
        return lambda x: F.linear(x, weight)
    with torch.inference_mode():
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda x: packed_linear(x, blocked, None, weight.shape[0])


def time_linear(shape: WeightShape, rows: int, repeats: int, dtype: torch.dtype = torch.bfloat16,
                packed: bool = False) -> float:
    """Seconds for one `F.linear` of `rows` rows through one matrix of `shape` (minimum of repeats)."""
    generator = torch.Generator().manual_seed(rows * 31 + shape.out_features)
    weight = (torch.randn(shape.out_features, shape.in_features, generator=generator) * 0.02).to(dtype)
    x = torch.randn(rows, shape.in_features, generator=generator).to(dtype)
    matmul = _matmul(weight, packed)
    best = float("inf")
    with torch.inference_mode():
        matmul(x)
        for _ in range(repeats):
            start = time.perf_counter()
            matmul(x)
            best = min(best, time.perf_counter() - start)
    return best


def weight_pass_floor_s(repeats: int = 5, dtype: torch.dtype = torch.bfloat16, packed: bool = False) -> float:
    """One row through every weight matrix of the model, each a separate tensor (so the pass streams
    all ~270 MB from memory, as a decode step does): torch's floor for single-stream decode."""
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(s.out_features, s.in_features, generator=generator) * 0.02).to(dtype)
               for s in ALL_SHAPES for _ in range(s.per_forward)]
    matmuls = [(w.shape[1], _matmul(w, packed)) for w in weights]
    xs = {k: torch.randn(1, k, generator=generator).to(dtype) for k in {s.in_features for s in ALL_SHAPES}}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for in_features, matmul in matmuls:
                matmul(xs[in_features])
            best = min(best, time.perf_counter() - start)
    return best
