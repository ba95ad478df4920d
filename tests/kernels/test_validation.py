"""Bad input raises KernelInputError with a message naming the problem, on both paths."""

from __future__ import annotations

import functools

import pytest
import torch

from kvserve.kernels import KernelInputError, paged_attention
from kvserve.kernels.triton_attention import triton_paged_attention
from tests.kernels.paged_batch import make_batch

ON_CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")


def _args(**changes):
    batch = make_batch([17, 5], [1, 5], group=2)
    args = dict(
        query=batch.query, key_cache=batch.key_cache, value_cache=batch.value_cache, block_tables=batch.block_tables,
        seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc, scale=batch.scale,
    )
    return args | changes


def _shape_errors():
    batch = _args()
    return {
        "query_dims": (dict(query=batch["query"][0]), "query must be"),
        "head_dim": (dict(query=batch["query"][..., :32]), "head_dim 32 differs"),
        "heads_not_multiple": (dict(query=batch["query"][:, :3]), "not a multiple"),
        "query_dtype": (dict(query=batch["query"].half()), "must equal the query dtype"),
        "int_query": (dict(query=batch["query"].int()), "query dtype must be"),
        "cache_mismatch": (dict(value_cache=batch["value_cache"][:, :1]), "same shape"),
        "cache_dtype_mismatch": (dict(value_cache=batch["value_cache"].double()), "same dtype"),
        "float_block_tables": (dict(block_tables=batch["block_tables"].float()), "block_tables must be int32 or int64"),
        "seq_count": (dict(seq_lens=batch["seq_lens"][:1]), "2 rows for 1 sequences"),
        "start_count": (dict(query_start_loc=batch["query_start_loc"][:2]), "num_seqs \\+ 1"),
        "num_decodes_past_seqs": (dict(num_decodes=3), "num_decodes must be in \\[0, 2\\]"),
        "num_decodes_negative": (dict(num_decodes=-1), "num_decodes must be in"),
    }


@pytest.mark.parametrize("case", list(_shape_errors()))
@pytest.mark.parametrize("implementation", [
    paged_attention,
    pytest.param(functools.partial(paged_attention, validate=False), id="unvalidated"),  # shapes are always checked
    pytest.param(triton_paged_attention, marks=ON_CPU_ONLY),
])
def test_shape_and_dtype_errors_are_caught_before_any_work(case: str, implementation) -> None:
    changes, message = _shape_errors()[case]
    with pytest.raises(KernelInputError, match=message):
        implementation(**_args(**changes))


def _value_errors():
    batch = _args()
    past_cache = batch["block_tables"].clone()
    past_cache[0, 1] = batch["key_cache"].shape[0]
    negative = batch["block_tables"].clone()
    negative[1, 0] = -1
    return {
        "block_past_cache": (dict(block_tables=past_cache), r"block_tables\[0, 1\] = \d+ is outside"),
        "block_negative": (dict(block_tables=negative), r"block_tables\[1, 0\] = -1 is outside"),
        "more_queries_than_context": (dict(seq_lens=torch.tensor([17, 4], dtype=torch.int32)), "more query tokens than context"),
        "context_past_table": (dict(seq_lens=torch.tensor([200, 5], dtype=torch.int32)), "needs more than"),
        "starts_not_ending_at_tokens": (dict(query_start_loc=torch.tensor([0, 1, 5], dtype=torch.int32)), "ends at 5"),
        "chunk_called_a_decode": (dict(num_decodes=2), "not all of the first 2 requests have exactly one query row"),
    }


@pytest.mark.parametrize("case", list(_value_errors()))
def test_torch_path_checks_metadata_contents(case: str) -> None:
    changes, message = _value_errors()[case]
    with pytest.raises(KernelInputError, match=message):
        paged_attention(**_args(**changes))


@ON_CPU_ONLY
def test_triton_debug_flag_checks_block_tables() -> None:
    changes, message = _value_errors()["block_past_cache"]
    with pytest.raises(KernelInputError, match=message):
        triton_paged_attention(**_args(**changes), check_block_tables=True)


def test_bad_fp8_scale_is_rejected() -> None:
    with pytest.raises(KernelInputError, match="k_scale must be a positive"):
        paged_attention(**_args(), k_scale=float("nan"))
