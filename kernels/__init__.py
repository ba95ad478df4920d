"""kvserve.kernels: paged attention and KV-cache writes. Imports nothing else of kvserve.

Two implementations of one contract (see torch_attention.py for the cache layout):
- torch: the CPU serving path and the test oracle;
- Triton (triton_*.py): the GPU path, imported lazily so machines without triton still work.
"""

from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.backends import (
    AttentionBackend,
    KVCache,
    TorchAttentionBackend,
    TritonAttentionBackend,
    select_attention_backend,
)
from kvserve.kernels.kv_quant import FP8_E4M3_MAX, fp8_scale_for
from kvserve.kernels.torch_attention import paged_attention, write_kv_cache
from kvserve.kernels.validation import FP8_KV_DTYPE, INT8_KV_DTYPE, KernelInputError

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "FP8_E4M3_MAX",
    "FP8_KV_DTYPE",
    "INT8_KV_DTYPE",
    "KVCache",
    "KernelInputError",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "fp8_scale_for",
    "paged_attention",
    "select_attention_backend",
    "write_kv_cache",
]
