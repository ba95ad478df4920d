"""quantize_model: swap a loaded model's nn.Linear layers for weight-only quantized ones, in place.

Runs after the weights are loaded and before the runner is built, so the model code and
torch.compile only ever see ordinary modules. Layers whose shape a mode cannot pack stay as they
are (and are reported), which keeps any Llama-family checkpoint loadable.

Under tensor parallelism each rank converts its shard, with the same result as converting the
unsharded layer and then slicing it: column-parallel rows keep their own scales; int4's groups
run along K within a rank's slice; a row-parallel int8 channel's scale comes from its maximum
over all ranks' slices (one all_reduce per layer, every rank converting the same layers in the
same order). A rank whose slice a mode cannot pack keeps it, as every rank then does alike.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.engine.config import SUPPORTED_QUANTIZATIONS
from kvserve.engine.model.parallel_layers import RowParallelLinear
from kvserve.engine.quantization.int4_linear import GROUP_SIZE, GROUP_SIZES, KERNELS, Int4Linear, int4_compatible
from kvserve.engine.quantization.int8_linear import Int8Linear

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = SUPPORTED_QUANTIZATIONS
# The output layer (lm_head) of a tied model is the token embedding, which GGUFs keep at 8 bits
# (SmolLM2: Q8_0) because logits are sensitive to it. In the int4 mode that is not free: at one
# row lm_head is ~30% of the bytes a forward reads (28 of ~94 MB), and at int4 it would take
# ~0.5-0.7x the time of int8 (noisy). But an int4 lm_head moves the next-token distribution far
# from bf16's: over the fixed passage, mean KL 0.073 nat/token against 0.004, argmax agreement
# 75% against 95%, NLL +2.2% against +0.15% (benchmarks/quant_accuracy.py).
OUTPUT_LAYER_MODE = {"int8": "int8", "int4": "int8"}
# Which few-row matmuls quantized layers run where quantize_model is not told: "auto" (kvserve's
# VNNI kernels where they run), "vnni" or "torch" (torch's ops: activations left unrounded, so a
# tensor-parallel shard computes what the unsharded layer does up to float32 summation order).
# An environment variable because every tensor-parallel worker process reads it.
KERNEL_ENV = "KVSERVE_QUANT_KERNEL"
# The VNNI kernels wherever they run: on a 2-core AMD EPYC Zen 4 they take 0.36-0.5x the time of
# torch's ops on the model's layers at 1-256 rows (benchmarks/quant_gemm.py, weights in cache) and
# single-stream int4 decode 0.69x (7.5 vs 11.0 ms/token; 0.87x llama.cpp's llama-bench on the same
# GGUF, 3 alternating rounds of benchmarks/int4_single_stream.py); on a Sapphire Rapids and an
# AVX-512 Xeon, where the int4 layers' bytes from memory bound both, single stream ran level. The
# price is llama.cpp's own: activations rounded to int8 in groups of 32 (mean KL from bf16 0.0070
# against torch's 0.0040 nat/token, benchmarks/quant_accuracy.py).
DEFAULT_KERNEL = "auto"
# The output layer, or its inner linear under tensor parallelism (engine/model/parallel_layers.py).
OUTPUT_LAYER_NAMES = ("lm_head", "lm_head.linear")


@dataclass(frozen=True)
class QuantizationSummary:
    mode: str
    quantized: tuple[str, ...]  # module names converted
    kept: tuple[str, ...]  # module names left in the model dtype (shape not packable)
    bytes_before: int  # weights of the converted layers, before and after
    bytes_after: int


def _int8(linear: nn.Linear, group_size: int, kernel: str, parent: nn.Module) -> nn.Module | None:
    return Int8Linear.from_linear(linear, parent.reduce_max if isinstance(parent, RowParallelLinear) else None, kernel)


def _int4(linear: nn.Linear, group_size: int, kernel: str, parent: nn.Module) -> nn.Module | None:
    if not int4_compatible(linear.out_features, linear.in_features, group_size):
        return None
    return Int4Linear.from_linear(linear, group_size, kernel)


_CONVERTERS: dict[str, Callable[[nn.Linear, int, str, nn.Module], nn.Module | None]] = {"int8": _int8, "int4": _int4}


def quantize_model(model: nn.Module, mode: str, *, output_layer_mode: str | None = None,
                   int4_group_size: int = GROUP_SIZE, kernel: str | None = None) -> QuantizationSummary:
    """Converts every nn.Linear of `model` to `mode`, and the output layer `lm_head` to
    `output_layer_mode` (default: OUTPUT_LAYER_MODE[mode]); int4 layers get groups of
    `int4_group_size` along K; every layer gets the few-row matmul `kernel` ("auto": kvserve's
    VNNI kernels where they run, else torch's ops; "vnni"; "torch"; None: $KVSERVE_QUANT_KERNEL,
    else DEFAULT_KERNEL). Returns what was converted."""
    if mode not in _CONVERTERS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    head_mode = output_layer_mode or OUTPUT_LAYER_MODE[mode]
    if head_mode not in _CONVERTERS:
        raise ValueError(f"output layer quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {head_mode!r}")
    kernel = kernel or os.environ.get(KERNEL_ENV) or DEFAULT_KERNEL
    if kernel not in KERNELS:
        raise ValueError(f"quantized kernel ({KERNEL_ENV}) must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if int4_group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {int4_group_size}")
    quantized, kept, before, after, on_vnni = [], [], 0, 0, 0
    targets = [(f"{parent_name}.{name}".lstrip("."), parent, name, child)
               for parent_name, parent in model.named_modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for full_name, parent, name, linear in targets:
        convert = _CONVERTERS[head_mode if full_name in OUTPUT_LAYER_NAMES else mode]
        replacement = convert(linear, int4_group_size, kernel, parent)
        if replacement is None:
            kept.append(full_name)
            continue
        before += linear.weight.numel() * linear.weight.element_size()
        after += sum(b.numel() * b.element_size() for b in replacement.buffers())
        on_vnni += replacement.vnni
        setattr(parent, name, replacement)
        quantized.append(full_name)
    summary = QuantizationSummary(mode, tuple(quantized), tuple(kept), before, after)
    logger.info("quantization %s: %d linear layers converted (%.1f MiB -> %.1f MiB), %d on kvserve's VNNI kernels, "
                "%d on torch's ops%s", mode, len(quantized), before / 2**20, after / 2**20, on_vnni,
                len(quantized) - on_vnni, f"; kept in {_dtype_of(model)}: {', '.join(kept)}" if kept else "")
    return summary


def _dtype_of(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")
