"""Input checks shared by every attention implementation.

Two tiers, because they cost differently:
- `check_*_shapes`: shapes, dtypes and devices only. They read tensor metadata on the host, never
  the data, so every path runs them before every call (no device sync, a few microseconds).
- `check_*_values`: block ids, slots and lengths. They read the tensors: a host sync on CUDA and
  several small ops per layer on the CPU. Entry points run them unless told `validate=False`
  (the serving backends, whose metadata the engine builds): the C++ kernel checks every block id
  and length as it reads it anyway, and torch's indexing raises on an out-of-range id.
"""

from __future__ import annotations

import torch

# e4m3 "fn" (finite, no inf) is the KV-quantisation format of vLLM/TensorRT-LLM: 3 mantissa bits
# keep more precision than e5m2, and K/V activations never need e5m2's range once scaled.
FP8_KV_DTYPE = torch.float8_e4m3fn
# int8 caches keep a float32 scale per token and KV head beside the blocks (kv_quant.py).
INT8_KV_DTYPE = torch.int8
QUANTIZED_KV_DTYPES = (FP8_KV_DTYPE, INT8_KV_DTYPE)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelInputError(ValueError):
    """An argument of a kernel entry point does not fit the paged-attention contract."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KernelInputError(message)


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Key and value caches share blocks, heads and block size; their head dims may differ
    (latent attention reads keys of kv_lora_rank + rope values and values of kv_lora_rank)."""
    _require(key_cache.dim() == 4 and value_cache.dim() == 4, f"key_cache and value_cache must be [num_blocks, num_kv_heads, block_size, head_dim], got shapes {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    _require(key_cache.shape[:3] == value_cache.shape[:3], f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must have the same shape but for head_dim")
    _require(key_cache.dtype == value_cache.dtype, f"key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) must have the same dtype")
    _require(key_cache.dtype in FLOAT_DTYPES + QUANTIZED_KV_DTYPES, f"KV cache dtype must be float32, float16, bfloat16, float8_e4m3fn or int8, got {key_cache.dtype}")
    _require(key_cache.device == value_cache.device, f"key_cache is on {key_cache.device} but value_cache on {value_cache.device}")
    _require(key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "KV caches must be contiguous in head_dim (the last dimension)")


def check_row_scales(key_cache: torch.Tensor, value_cache: torch.Tensor, key_scales: torch.Tensor | None,
                     value_scales: torch.Tensor | None) -> None:
    """An int8 cache comes with its per-(token, KV head) scales, [num_blocks, num_kv_heads,
    block_size] float32 each (the cache's shape without head_dim); other caches come without."""
    if key_cache.dtype != INT8_KV_DTYPE:
        _require(key_scales is None and value_scales is None, f"per-token scales belong to int8 caches only, not to a {key_cache.dtype} cache")
        return
    _require(not values_alias_keys(key_cache, value_cache), "latent (MLA) caches cannot be int8: use a float or fp8 cache")
    _require(key_scales is not None and value_scales is not None, "an int8 KV cache needs key_scales and value_scales (a float32 scale per token and KV head)")
    for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
        _require(tuple(scales.shape) == tuple(key_cache.shape[:3]), f"{name} must be [num_blocks, num_kv_heads, block_size] = {tuple(key_cache.shape[:3])}, got {tuple(scales.shape)}")
        _require(scales.dtype == torch.float32, f"{name} must be float32, got {scales.dtype}")
        _require(scales.device == key_cache.device, f"{name} is on {scales.device} but the KV cache is on {key_cache.device}")
        _require(scales.stride(-1) == 1, f"{name} must be contiguous in block_size (the last dimension)")


def values_alias_keys(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the value cache is the key cache's first head_dim_v columns (latent attention's
    one latent per token): then writing the keys writes the values, and the keys read are the
    values read. Tensor metadata only."""
    return (value_cache.data_ptr() == key_cache.data_ptr() and value_cache.stride() == key_cache.stride()
            and value_cache.shape[:3] == key_cache.shape[:3] and value_cache.shape[3] <= key_cache.shape[3])


def _check_index_tensor(name: str, tensor: torch.Tensor, dims: int, device: torch.device) -> None:
    _require(tensor.dim() == dims, f"{name} must have {dims} dimension(s), got shape {tuple(tensor.shape)}")
    _require(tensor.dtype in INDEX_DTYPES, f"{name} must be int32 or int64, got {tensor.dtype}")
    _require(tensor.device == device, f"{name} is on {tensor.device} but the KV cache is on {device}: move it to the cache's device")


def check_write_shapes(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
    key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
) -> None:
    check_cache_pair(key_cache, value_cache)
    check_row_scales(key_cache, value_cache, key_scales, value_scales)
    _, num_kv_heads, _, head_dim = key_cache.shape
    _require(key.dim() == 3 and value.dim() == 3 and key.shape[:2] == value.shape[:2], f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [num_tokens, num_kv_heads, head_dim]")
    _require(tuple(key.shape[1:]) == (num_kv_heads, head_dim), f"key rows are {tuple(key.shape[1:])} (kv_heads, head_dim) but the cache holds ({num_kv_heads}, {head_dim})")
    _require(value.shape[2] == value_cache.shape[3], f"value rows have head_dim {value.shape[2]} but the value cache holds {value_cache.shape[3]}")
    _require(key.dtype in FLOAT_DTYPES and key.dtype == value.dtype, f"key and value must share a float dtype, got {key.dtype} and {value.dtype}")
    _require(key.device == key_cache.device and value.device == key_cache.device, f"key/value are on {key.device} but the KV cache is on {key_cache.device}")
    _check_index_tensor("slot_mapping", slot_mapping, 1, key_cache.device)
    _require(slot_mapping.shape[0] == key.shape[0], f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} key/value rows")


def check_write_values(slot_mapping: torch.Tensor, key_cache: torch.Tensor) -> None:
    num_slots = key_cache.shape[0] * key_cache.shape[2]
    if slot_mapping.numel() == 0:
        return
    lowest, highest = int(slot_mapping.min()), int(slot_mapping.max())
    _require(lowest >= -1, f"slot_mapping holds {lowest}; slots are >= 0, or -1 for padding that is not written")
    _require(highest < num_slots, f"slot_mapping holds slot {highest} but the cache has only {num_slots} slots ({key_cache.shape[0]} blocks x {key_cache.shape[2]})")


def check_attention_shapes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_decodes: int | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    check_cache_pair(key_cache, value_cache)
    check_row_scales(key_cache, value_cache, key_scales, value_scales)
    _, num_kv_heads, _, head_dim = key_cache.shape
    _require(query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    _require(query.dtype in FLOAT_DTYPES, f"query dtype must be float32, float16 or bfloat16, got {query.dtype}")
    _require(query.shape[2] == head_dim, f"query head_dim {query.shape[2]} differs from the key cache's {head_dim}")
    _require(query.shape[1] % num_kv_heads == 0, f"{query.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads (GQA needs a whole group per KV head)")
    _require(key_cache.dtype in (query.dtype, *QUANTIZED_KV_DTYPES), f"KV cache dtype {key_cache.dtype} must equal the query dtype {query.dtype} or be float8_e4m3fn or int8")
    _require(query.device == key_cache.device, f"query is on {query.device} but the KV cache is on {key_cache.device}")
    _check_index_tensor("block_tables", block_tables, 2, key_cache.device)
    _check_index_tensor("seq_lens", seq_lens, 1, key_cache.device)
    _check_index_tensor("query_start_loc", query_start_loc, 1, key_cache.device)
    num_seqs = seq_lens.shape[0]
    _require(block_tables.shape[0] == num_seqs, f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    _require(query_start_loc.shape[0] == num_seqs + 1, f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, got {query_start_loc.shape[0]}")
    check_num_decodes(num_decodes, num_seqs, query.shape[0])


def check_num_decodes(num_decodes: int | None, num_seqs: int, num_tokens: int) -> None:
    """O(1): the decodes-first split must fit the batch (each decode has one query row)."""
    if num_decodes is not None:
        _require(0 <= num_decodes <= min(num_seqs, num_tokens), f"num_decodes must be in [0, {min(num_seqs, num_tokens)}] (sequences with a query row each), got {num_decodes}")


def check_attention_values(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_decodes: int | None = None,
) -> None:
    """Reads the metadata: lengths must be consistent and every block a sequence uses must exist.
    Entries past a sequence's last block are padding and may hold anything. With `num_decodes`,
    the first num_decodes requests must have one query row each."""
    num_blocks, _, block_size, _ = key_cache.shape
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    _require(int(starts[0]) == 0, f"query_start_loc must start at 0, got {int(starts[0])}")
    _require(int(starts[-1]) == query.shape[0], f"query_start_loc ends at {int(starts[-1])} but query has {query.shape[0]} rows")
    if seq_lens.numel() == 0:
        return
    _require(bool((q_lens >= 0).all()), "query_start_loc must be non-decreasing")
    if num_decodes:
        _require(bool((q_lens[:num_decodes] == 1).all()), f"num_decodes = {num_decodes} but not all of the first {num_decodes} requests have exactly one query row")
    seq_lens_long = seq_lens.long()
    bad = torch.nonzero(q_lens > seq_lens_long).flatten()
    _require(bad.numel() == 0, f"sequence {int(bad[0]) if bad.numel() else -1} has more query tokens than context (seq_lens counts this step's tokens too)")
    capacity = block_tables.shape[1] * block_size
    _require(int(seq_lens_long.max()) <= capacity, f"a sequence of {int(seq_lens_long.max())} tokens needs more than the {block_tables.shape[1]} blocks of its block table row")
    blocks_used = (seq_lens_long + block_size - 1) // block_size
    in_use = torch.arange(block_tables.shape[1], device=block_tables.device).unsqueeze(0) < blocks_used.unsqueeze(1)
    out_of_range = in_use & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(out_of_range.any()):
        seq, column = (int(x) for x in torch.nonzero(out_of_range)[0])
        raise KernelInputError(
            f"block_tables[{seq}, {column}] = {int(block_tables[seq, column])} is outside the KV cache's {num_blocks} blocks"
        )
