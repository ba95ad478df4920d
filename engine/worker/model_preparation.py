"""What every rank does to its freshly loaded shard before serving, in one order:

    1. quantize  (--quantization int8|int4) swaps nn.Linear for weight-only quantized modules;
                 a row-parallel layer's inner linear is swapped, so its all_reduce stays
    2. prepack   (CPU, bf16; float32 where --dtype auto chose it) reorders the remaining
                 nn.Linear weights into oneDNN's blocked layout once; after quantization, whose
                 modules it must not touch; and routes the gated MLPs' bf16 SiLU to kvserve's
                 kernel where it is built
    3. compile   (the runner, unless --enforce-eager) traces the final modules: a layer is
                 traced as it is when first run, and later changes go unnoticed

The KV cache is sized between 2 and 3 (engine/worker/kv_cache_sizing.py) from the weights'
bytes as quantization left them (prepacked weights are opaque tensors of about the same size).
"""

from __future__ import annotations

import logging

import torch

from kvserve.engine.kv_memory import MemorySources, cpu_memory_headroom
from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model.packed_linear import (PackedLinear, few_rows_weight_bytes, pack_linear_weights,
                                                packable_weight_bytes)
from kvserve.engine.model.protocol import CausalLM
from kvserve.engine.quantization import quantize_model
from kvserve.kernels.cpu_bf16_gemm import bf16_gemm_available

logger = logging.getLogger(__name__)


def quantize(model: CausalLM, quantization: str | None) -> int:
    """Step 1; returns the bytes of the model's weights afterwards."""
    if quantization is not None:
        quantize_model(model, quantization)
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


# The few-row bf16 kernel keeps a second copy of the weights beside oneDNN's: 256 MiB for
# SmolLM2-135M, but 14 GB for a 7B model, which would not fit beside its first copy on many
# machines. The copy is made only while it takes at most this share of the memory left after the
# weights (the share the KV cache takes by default); bigger models run oneDNN at every row count.
FEW_ROWS_COPY_MAX_SHARE = 0.25


def prepack(model: CausalLM, device: torch.device, weights_bytes: int,
            memory_sources: MemorySources = MemorySources(), float32: bool = False) -> int:
    """Step 2; returns the bytes it added (the few-row kernel's copy of bf16 weights), which the
    KV cache's budget must leave room for as for the weights. `float32`: pack float32 weights
    too (where `--dtype auto` chose float32 for speed; packed_linear.py)."""
    if device.type != "cpu":
        return 0
    few_rows = bf16_gemm_available()
    if few_rows:
        silu = sum(m.use_cpu_silu_kernel() for m in model.modules() if isinstance(m, GatedMLP))
        if silu:
            logger.info("%d gated MLPs' bf16 SiLU x up on kvserve's kernel", silu)
    copy_bytes = packable_weight_bytes(model) if few_rows else 0
    if copy_bytes:
        headroom = cpu_memory_headroom(weights_bytes, memory_sources)
        few_rows = headroom is not None and copy_bytes <= FEW_ROWS_COPY_MAX_SHARE * headroom
        if not few_rows:
            logger.info("few-row bf16 kernel off: its copy of the weights (%.2f GiB) would take more than "
                        "%.0f%% of the %s left after them; oneDNN serves every row count",
                        copy_bytes / 2**30, 100 * FEW_ROWS_COPY_MAX_SHARE,
                        "memory" if headroom is None else f"{headroom / 2**30:.2f} GiB")
    packed = pack_linear_weights(model, few_rows_kernel=few_rows, float32=float32)
    added = few_rows_weight_bytes(model)
    kernel_only = sum(m.packed_weight is None for m in model.modules() if isinstance(m, PackedLinear))
    onednn = packed - kernel_only
    if onednn or not kernel_only:
        logger.info("%d linear layers' weights prepacked for oneDNN%s", onednn,
                    f", and for the few-row bf16 kernel (+{added / 2**20:.0f} MiB)" if added else "")
    if kernel_only:
        logger.info("%d linear layers' weights packed for kvserve's bf16 kernel alone (this CPU has no bf16 "
                    "arithmetic, which oneDNN would emulate)", kernel_only)
    return added
