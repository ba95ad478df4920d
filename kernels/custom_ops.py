"""The attention kernels as torch.library custom ops, so that torch.compile keeps each call as one
opaque node in its graph instead of breaking the graph around it (the torch kernel reads lengths
on the host; the Triton one launches programs). Eager callers use the same ops.

Each op has a fake implementation that only states the output's shape, which is all the
compiler needs. Host-side ints (max_query_len, max_seq_len, num_decodes) are plain op arguments;
the compile wrapper keeps them symbolic so that a new value never means a new graph.
"""

from __future__ import annotations

import torch

from kvserve.kernels import torch_attention
from kvserve.kernels.kv_quant import row_scales


# Registration is process-wide by nature (torch's operator registry); this module does it once,
# on import. Library.define/impl rather than @custom_op: the latter's per-call checks cost ~20 us,
# and a forward makes two calls per layer.
_LIBRARY = torch.library.Library("kvserve", "FRAGMENT")
_WRITE_ARGS = ("Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, float? k_scale, "
               "float? v_scale, Tensor(c!)? key_scales, Tensor(d!)? value_scales")
_ATTENTION_ARGS = ("Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
                   "Tensor query_start_loc, float scale, SymInt? max_query_len, SymInt? max_seq_len, "
                   "SymInt? num_decodes, float? k_scale, float? v_scale, SymInt sliding_window, float soft_cap, "
                   "Tensor? key_scales, Tensor? value_scales")


def _torch_write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, key_scales, value_scales,
                          validate) -> None:
    torch_attention.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                                   key_scales=row_scales(key_scales), value_scales=row_scales(value_scales), validate=validate)


def _triton_write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, key_scales, value_scales,
                           check_slots) -> None:
    # Imported here so that machines without triton can still use the torch ops.
    from kvserve.kernels.triton_kv_write import triton_write_kv_cache as write

    write(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale, key_scales=row_scales(key_scales),
          value_scales=row_scales(value_scales), check_slots=check_slots)


def _torch_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                           max_query_len, max_seq_len, num_decodes, k_scale, v_scale, sliding_window, soft_cap,
                           key_scales, value_scales, validate) -> torch.Tensor:
    return torch_attention.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len, num_decodes=num_decodes, k_scale=k_scale,
        v_scale=v_scale, sliding_window=sliding_window, soft_cap=soft_cap, key_scales=row_scales(key_scales),
        value_scales=row_scales(value_scales), validate=validate,
    )


def _triton_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                           max_query_len, max_seq_len, num_decodes, k_scale, v_scale, sliding_window, soft_cap,
                           key_scales, value_scales, check_block_tables) -> torch.Tensor:
    from kvserve.kernels.triton_attention import triton_paged_attention as attend

    return attend(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len, num_decodes=num_decodes, k_scale=k_scale,
        v_scale=v_scale, sliding_window=sliding_window, soft_cap=soft_cap, key_scales=row_scales(key_scales),
        value_scales=row_scales(value_scales), check_block_tables=check_block_tables,
    )


def _fake_write(*args) -> None:
    return None


def _fake_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *args) -> torch.Tensor:
    return query.new_empty(*query.shape[:2], value_cache.shape[-1])  # the values' width


for _name, _schema, _impl, _fake in (
    ("torch_write_kv_cache", f"({_WRITE_ARGS}, bool validate) -> ()", _torch_write_kv_cache, _fake_write),
    ("triton_write_kv_cache", f"({_WRITE_ARGS}, bool check_slots) -> ()", _triton_write_kv_cache, _fake_write),
    ("torch_paged_attention", f"({_ATTENTION_ARGS}, bool validate) -> Tensor", _torch_paged_attention, _fake_attention),
    ("triton_paged_attention", f"({_ATTENTION_ARGS}, bool check_block_tables) -> Tensor", _triton_paged_attention, _fake_attention),
):
    _LIBRARY.define(_name + _schema)
    _LIBRARY.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kvserve::{_name}", _fake, lib=_LIBRARY)


# What the backends call: eager, each runs its kernel; under torch.compile, each is one graph node.
torch_write_kv_cache = torch.ops.kvserve.torch_write_kv_cache.default
triton_write_kv_cache = torch.ops.kvserve.triton_write_kv_cache.default
torch_paged_attention = torch.ops.kvserve.torch_paged_attention.default
triton_paged_attention = torch.ops.kvserve.triton_paged_attention.default
