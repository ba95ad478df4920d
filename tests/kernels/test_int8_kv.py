"""int8 KV caches (a float32 scale per token and KV head, kv_quant.py) on every path.

- Writes: the serving entry (the C++ kernel on the CPU), plain torch (the oracle) and Triton
  store the same int8 rows and the same scales, bit for bit.
- Attention: the C++ kernel and Triton read the oracle's caches to its answer within the float
  tolerances of the float caches (GQA, decodes next to prompt chunks, decodes-first, a sliding
  window, split-KV); blocks before a window are never read (their scales are NaN here).
- Accuracy: against fp32 attention on the unquantised K/V, within 1.5% relative (Frobenius)
  error; measured 0.7% for Gaussian K/V at head_dim 64, fp32 and bf16 queries (fp8's per-tensor
  e4m3, tests/kernels/test_fp8_accuracy.py: ~3.2%).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.kernels import INT8_KV_DTYPE, KernelInputError, paged_attention, write_kv_cache
from kvserve.kernels.kv_quant import quantize_rows_int8
from kvserve.kernels.torch_attention import torch_paged_attention, torch_write_kv_cache
from kvserve.kernels.triton_attention import triton_paged_attention
from kvserve.kernels.triton_kv_write import triton_write_kv_cache
from tests.kernels.paged_batch import (
    DECODES_FIRST_QUERY_LENS,
    DECODES_FIRST_SEQ_LENS,
    MIXED_QUERY_LENS,
    MIXED_SEQ_LENS,
    NUM_DECODES,
    TOLERANCES,
    PagedBatch,
    dense_attention,
    make_batch,
)

INT8_RELATIVE_TOLERANCE = 0.015
INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")
WRITERS = {"serving": write_kv_cache, "triton": triton_write_kv_cache}
ATTENTION = {"serving": paged_attention, "triton": triton_paged_attention}
PATHS = [pytest.param("serving", id="cpu-kernel"), pytest.param("triton", id="triton", marks=INTERPRETER)]

Int8Cache = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _int8_cache(batch: PagedBatch, writer=torch_write_kv_cache) -> Int8Cache:
    """The batch's unquantised K/V written through `writer` into fresh int8 caches."""
    key_cache = torch.zeros_like(batch.key_cache, dtype=INT8_KV_DTYPE)
    value_cache = torch.zeros_like(key_cache)
    key_scales = torch.zeros(key_cache.shape[:3])
    value_scales = torch.zeros_like(key_scales)
    block_size = key_cache.shape[2]
    for i, (k, v) in enumerate(zip(batch.dense_keys, batch.dense_values, strict=True)):
        positions = torch.arange(k.shape[0])
        slots = batch.block_tables[i, positions // block_size].long() * block_size + positions % block_size
        writer(k.to(batch.query.dtype), v.to(batch.query.dtype), key_cache, value_cache, slots,
               key_scales=key_scales, value_scales=value_scales)
    return key_cache, value_cache, key_scales, value_scales


def _attend(attend, batch: PagedBatch, cache: Int8Cache, **options) -> torch.Tensor:
    key_cache, value_cache, key_scales, value_scales = cache
    return attend(batch.query, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                  batch.scale, key_scales=key_scales, value_scales=value_scales, **options).float()


def test_rows_quantise_symmetrically_per_row() -> None:
    rows = torch.tensor([[[1.0, -2.0, 0.5, 127.0]], [[0.0, 0.0, 0.0, 0.0]]])
    codes, scales = quantize_rows_int8(rows)
    assert scales.tolist() == [[1.0], [0.0]]  # absmax / 127; a zero row gets 0
    assert codes.tolist() == [[[1, -2, 0, 127]], [[0, 0, 0, 0]]]  # 0.5 rounds to even


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_match_the_oracle_bit_for_bit(path: str, dtype: torch.dtype) -> None:
    batch = make_batch([17, 40], [1, 5], num_kv_heads=3, dtype=dtype)  # the interpreter runs a program per token
    written, oracle = _int8_cache(batch, WRITERS[path]), _int8_cache(batch)
    for tensor, expected in zip(written, oracle, strict=True):
        assert torch.equal(tensor, expected)
    assert oracle[0].abs().max() == 127  # each row's largest value uses the full range


CASES = {
    "gqa3-mixed": dict(batch=dict(group=3)),
    "mha-decodes-first": dict(batch=dict(group=1), decodes_first=True),
    "window20": dict(batch=dict(group=3), options=dict(sliding_window=20)),
    "bf16": dict(batch=dict(group=3, dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_the_oracle(path: str, case: str) -> None:
    spec = CASES[case]
    decodes_first = spec.get("decodes_first", False)
    seq_lens, query_lens = (DECODES_FIRST_SEQ_LENS, DECODES_FIRST_QUERY_LENS) if decodes_first else (MIXED_SEQ_LENS, MIXED_QUERY_LENS)
    batch = make_batch(seq_lens, query_lens, **spec["batch"])
    options = dict(spec.get("options", {}), **(dict(num_decodes=NUM_DECODES) if decodes_first else {}))
    cache = _int8_cache(batch)
    expected = _attend(torch_paged_attention, batch, cache, **options)
    torch.testing.assert_close(_attend(ATTENTION[path], batch, cache, **options), expected, **TOLERANCES[batch.query.dtype])


@pytest.mark.parametrize("splits", [2, 3])
@INTERPRETER
def test_triton_split_kv_matches_the_oracle(splits: int) -> None:
    batch = make_batch([200, 33, 17], [1, 1, 1], group=3)
    cache = _int8_cache(batch)
    torch.testing.assert_close(_attend(triton_paged_attention, batch, cache, num_kv_splits=splits),
                               _attend(torch_paged_attention, batch, cache), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("path", [pytest.param("torch", id="oracle"), *PATHS])
def test_blocks_before_the_window_are_never_read(path: str) -> None:
    """A window group gives blocks back: their table entries point at a block whose scales are NaN."""
    batch = make_batch([200, 150, 40], [1, 16, 5], group=2)
    key_cache, value_cache, key_scales, value_scales = _int8_cache(batch)
    poisoned = min(set(range(key_cache.shape[0])) - set(batch.block_tables.flatten().tolist()))
    key_scales[poisoned] = value_scales[poisoned] = float("nan")
    tables = batch.block_tables.clone()
    window = 24
    for i, (seq_len, q_len) in enumerate([(200, 1), (150, 16), (40, 5)]):
        tables[i, : max(0, seq_len - q_len - window + 1) // 16] = poisoned
    poisoned_batch = dataclasses.replace(batch, block_tables=tables)
    attend = {"torch": torch_paged_attention, **ATTENTION}[path]
    out = _attend(attend, poisoned_batch, (key_cache, value_cache, key_scales, value_scales), sliding_window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, dense_attention(batch, window), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("path", [pytest.param("torch", id="oracle"), *PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_against_float_attention_is_bounded(path: str, dtype: torch.dtype) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=3, dtype=dtype)
    attend = {"torch": torch_paged_attention, **ATTENTION}[path]
    reference = dense_attention(batch)
    error = ((_attend(attend, batch, _int8_cache(batch)) - reference).norm() / reference.norm()).item()
    assert 0 < error < INT8_RELATIVE_TOLERANCE  # > 0: the cache really was quantised


def test_int8_caches_need_their_scales_and_no_per_tensor_scale() -> None:
    batch = make_batch([17], [1])
    key_cache, value_cache, key_scales, value_scales = _int8_cache(batch)
    args = (batch.query, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale)
    with pytest.raises(KernelInputError, match="needs key_scales and value_scales"):
        paged_attention(*args)
    with pytest.raises(KernelInputError, match="k_scale/v_scale must be None"):
        paged_attention(*args, key_scales=key_scales, value_scales=value_scales, k_scale=0.5)
    with pytest.raises(KernelInputError, match=r"\[num_blocks, num_kv_heads, block_size\]"):
        paged_attention(*args, key_scales=key_scales[:, :1], value_scales=value_scales)
    with pytest.raises(KernelInputError, match="belong to int8 caches only"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, *args[3:], key_scales=key_scales,
                        value_scales=value_scales)


@pytest.mark.parametrize("validate", [False, True], ids=["native-ops", "custom-ops"])
def test_the_torch_backend_reads_and_writes_scales_held_as_page_bytes(validate: bool) -> None:
    """The engine's pages hold the scales as bytes ([..., 4] int8: a compiled forward cannot
    mutate a float32 view of int8 storage); the backend's write and attention take them so."""
    from kvserve.kernels import AttentionMetadata, TorchAttentionBackend
    from kvserve.kernels.kv_quant import row_scales

    batch = make_batch([40, 17], [5, 1], group=3)
    key_cache, value_cache, key_scales, value_scales = _int8_cache(batch)
    expected = _attend(torch_paged_attention, batch, (key_cache, value_cache, key_scales, value_scales))
    as_bytes = [torch.zeros(*key_scales.shape, 4, dtype=INT8_KV_DTYPE) for _ in range(2)]
    cache = (torch.zeros_like(key_cache), torch.zeros_like(value_cache), *as_bytes)
    backend = TorchAttentionBackend(validate=validate)
    metadata = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=batch.block_tables.clamp(min=0),
                                 seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc, max_query_len=5,
                                 max_seq_len=40, num_decodes=0)
    block_size = key_cache.shape[2]
    for i, (k, v) in enumerate(zip(batch.dense_keys, batch.dense_values, strict=True)):
        positions = torch.arange(k.shape[0])
        slots = batch.block_tables[i, positions // block_size].long() * block_size + positions % block_size
        backend.write_kv_cache(k, v, cache, dataclasses.replace(metadata, slot_mapping=slots))
    assert torch.equal(cache[0], key_cache) and torch.equal(row_scales(cache[2]), key_scales)
    assert torch.equal(cache[1], value_cache) and torch.equal(row_scales(cache[3]), value_scales)
    out = backend.paged_attention(batch.query, cache, metadata, batch.scale).float()
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
