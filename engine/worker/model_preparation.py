"""What every rank does to its freshly loaded shard before serving, in one order:

    1. quantize  (--quantization int8|int4) swaps nn.Linear for weight-only quantized modules;
                 a row-parallel layer's inner linear is swapped, so its all_reduce stays
    2. prepack   (CPU, bf16) reorders the remaining nn.Linear weights into oneDNN's blocked
                 layout once; after quantization, whose modules it must not touch
    3. compile   (the runner, unless --enforce-eager) traces the final modules: a layer is
                 traced as it is when first run, and later changes go unnoticed

The KV cache is sized between 2 and 3 (engine/worker/kv_cache_sizing.py) from the weights'
bytes as quantization left them (prepacked weights are opaque tensors of about the same size).
"""

from __future__ import annotations

import logging

import torch

from kvserve.engine.model.packed_linear import few_rows_weight_bytes, pack_linear_weights
from kvserve.engine.model.protocol import CausalLM
from kvserve.engine.quantization import quantize_model

logger = logging.getLogger(__name__)


def quantize(model: CausalLM, quantization: str | None) -> int:
    """Step 1; returns the bytes of the model's weights afterwards."""
    if quantization is not None:
        quantize_model(model, quantization)
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def prepack(model: CausalLM, device: torch.device) -> int:
    """Step 2; returns the bytes it added (the few-row kernel's copy of bf16 weights), which the
    KV cache's budget must leave room for as for the weights."""
    if device.type != "cpu":
        return 0
    packed = pack_linear_weights(model)
    added = few_rows_weight_bytes(model)
    logger.info("%d linear layers' weights prepacked for oneDNN%s", packed,
                f", and for the few-row bf16 kernel (+{added / 2**20:.0f} MiB)" if added else "")
    return added
