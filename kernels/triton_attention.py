"""Paged attention on the GPU: launch planning for the Triton programs in triton_attention_kernels.

Everything here reads tensor shapes only, never their contents, so a step costs one launch (two
when the KV range is split) and no host synchronisation. The split count comes from shapes and
the optional `max_seq_len` hint: flash-decoding pays off when few (request, KV head) programs
would leave most SMs idle while each walks a long context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kvserve.kernels.kv_quant import check_int8_scales, check_scale
from kvserve.kernels.triton_attention_kernels import merge_splits_kernel, paged_attention_kernel
from kvserve.kernels.validation import KernelInputError, check_attention_shapes, check_attention_values

LOG2_E = 1.4426950408889634
MIN_DOT_SIZE = 16  # tl.dot on NVIDIA GPUs needs every dimension >= 16
MAX_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256  # below this the merge costs more than the parallelism gains
# A program's fp32 accumulator, rows x value dims, at most this many elements (64 rows of 256
# dims): latent attention's 512-dim values over 128 heads of one KV head run in head blocks.
MAX_ACCUMULATOR = 64 * 256


class StepLaunches:
    """One step's launch set-up, shared by its layers: the first layer of a shape checks the
    shapes, plans the launch and allocates the split-KV buffers; every later layer of the step
    with the same shapes (a model's layers all have them) reuses that (TritonAttentionBackend.prepare
    attaches one to the step's metadata)."""

    def __init__(self) -> None:
        self._by_shape: dict[tuple, tuple[LaunchPlan, torch.Tensor | None, torch.Tensor | None]] = {}

    @staticmethod
    def key(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple:
        return (tuple(query.shape), query.stride(), query.dtype, query.device, tuple(key_cache.shape),
                key_cache.stride(), key_cache.dtype, tuple(value_cache.shape), value_cache.stride())

    def get(self, key: tuple) -> tuple[LaunchPlan, torch.Tensor | None, torch.Tensor | None] | None:
        return self._by_shape.get(key)

    def put(self, key: tuple, launch: tuple[LaunchPlan, torch.Tensor | None, torch.Tensor | None]) -> None:
        self._by_shape[key] = launch


@dataclass(frozen=True)
class LaunchPlan:
    block_q: int  # query tokens per program
    group_block: int  # query heads of one KV head per program (a power of 2)
    head_blocks: int  # programs per KV head along the heads: ceil(group / group_block)
    tile: int  # context positions per inner-loop step
    num_splits: int
    kv_split_len: int  # context positions per split (a multiple of `tile`)

    def __post_init__(self) -> None:
        if self.block_q < 1 or self.head_blocks < 1 or self.num_splits < 1 or self.kv_split_len % self.tile:
            raise ValueError(f"inconsistent launch plan {self}")


def plan_launch(
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_context: int,
    num_sms: int,
    num_kv_splits: int | None = None,
    max_query_len: int | None = None,
    value_dim: int | None = None,
    group_block: int | None = None,
) -> LaunchPlan:
    """Tile sizes and split count from shapes alone. `head_dim` is the keys' width, `value_dim`
    the values' (None: the same). `num_kv_splits` and `group_block` force a split count and a
    head block (tests use them on tiny shapes)."""
    group_pad = triton.next_power_of_2(group)
    value_pad = triton.next_power_of_2(value_dim or head_dim)
    if group_block is None:
        group_block = min(group_pad, max(1, MAX_ACCUMULATOR // value_pad))
    group_block = min(group_block, group_pad)
    # Every scheduled request brings >= 1 token, so as many tokens as requests means all decodes.
    decode_only = max_query_len == 1 or num_tokens == num_seqs
    rows = MIN_DOT_SIZE if decode_only else 64  # prompt chunks amortise bigger tiles
    rows = min(rows, max(MIN_DOT_SIZE, MAX_ACCUMULATOR // value_pad))
    block_q = max(1, rows // group_block)
    head_blocks = math.ceil(group / group_block)
    tile = 64 if max(head_dim, value_pad) <= 128 else 32
    max_context = max(max_context, 1)
    if num_kv_splits is None:
        programs = (num_tokens // block_q + num_seqs) * num_kv_heads if not decode_only else num_seqs * num_kv_heads
        wanted = math.ceil(2 * num_sms / max(programs * head_blocks, 1))
        num_kv_splits = max(1, min(MAX_SPLITS, wanted, max_context // MIN_TOKENS_PER_SPLIT))
    per_split = math.ceil(math.ceil(max_context / num_kv_splits) / tile) * tile
    num_splits = math.ceil(max_context / per_split)  # never launch a split that can hold no keys
    return LaunchPlan(block_q=block_q, group_block=group_block, head_blocks=head_blocks, tile=tile,
                      num_splits=num_splits, kv_split_len=per_split)


def triton_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [num_seqs], this step's tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_decodes: int | None = None,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    group_block: int | None = None,
    check_block_tables: bool = False,
    launches: StepLaunches | None = None,
) -> torch.Tensor:
    """Same contract as `torch_attention.paged_attention`. `check_block_tables` validates the
    metadata's contents (a host sync: for debugging, not serving); `num_kv_splits` forces the
    flash-decoding split count and `group_block` the query heads per program (tests use them to
    exercise the merge and the head blocks on tiny shapes). Keys may be wider than values (a
    latent cache: its values are its keys' first dims); the output has the values' width. One
    launch covers decodes and chunks alike, so `num_decodes` only tells the planner when all are
    decodes. `sliding_window` w > 0: position p sees keys p - w + 1 .. p, and a tile reads from
    its first query's window start only (the splits cover the window, not the whole context).
    `soft_cap` c > 0: each scaled score s becomes c * tanh(s / c) before the softmax.
    `launches` (one per step) carries the checks, plan and buffers from the step's first layer
    to the others."""
    key = StepLaunches.key(query, key_cache, value_cache) if launches is not None else None
    launch = launches.get(key) if launches is not None else None
    if launch is None:
        check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, num_decodes,
                               key_scales, value_scales)
        if query.stride(-1) != 1:
            raise KernelInputError("query must be contiguous in head_dim (the last dimension); call .contiguous() first")
        if value_cache.shape[3] > key_cache.shape[3]:
            raise KernelInputError(f"the Triton kernel needs values no wider than keys, got {value_cache.shape[3]} > "
                                   f"{key_cache.shape[3]}; use the torch backend")
        if value_cache.shape[3] < MIN_DOT_SIZE:
            raise KernelInputError(f"the Triton kernel needs head_dim >= {MIN_DOT_SIZE}, got {value_cache.shape[3]}; use the torch backend")
    if check_block_tables:
        check_attention_values(query, key_cache, block_tables, seq_lens, query_start_loc, num_decodes)
    num_tokens, num_heads, head_dim = query.shape
    value_dim = value_cache.shape[3]
    out = query.new_empty(num_tokens, num_heads, value_dim)
    num_seqs = seq_lens.shape[0]
    _, num_kv_heads, block_size, _ = key_cache.shape
    if num_tokens == 0:
        return out
    k_scale_value, out_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    check_int8_scales(key_cache.dtype, k_scale_value, out_scale)
    score_scale = scale * k_scale_value
    if not soft_cap >= 0:
        raise KernelInputError(f"soft_cap must be >= 0 (0: no soft-capping), got {soft_cap}")
    # Capped scores are capped in natural units, then taken to log2 units.
    score_scale_log2 = score_scale if soft_cap else score_scale * LOG2_E
    group = num_heads // num_kv_heads
    on_gpu = query.device.type == "cuda"
    value_pad = triton.next_power_of_2(value_dim)
    tail_dim = head_dim - value_dim  # key dims past the values' (a latent's rope key)
    if launch is None:
        num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count if on_gpu else 1
        max_context = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        if sliding_window > 0:  # a tile of <= 64 queries reads at most w + 63 positions
            max_context = min(max_context, sliding_window + 63)
        plan = plan_launch(num_tokens, num_seqs, num_kv_heads, group, head_dim, max_context, num_sms, num_kv_splits,
                           1 if num_decodes == num_seqs else max_query_len, value_dim, group_block)
        partial_out = partial_lse = None  # a single split writes `out` directly
        if plan.num_splits > 1:
            partial_out = torch.empty(plan.num_splits, num_tokens, num_heads, value_pad, dtype=torch.float32, device=query.device)
            partial_lse = torch.empty(plan.num_splits, num_tokens, num_heads, dtype=torch.float32, device=query.device)
        launch = (plan, partial_out, partial_lse)
        if launches is not None:
            launches.put(key, launch)
    plan, partial_out, partial_lse = launch
    if partial_out is None:  # never read by the single-split program; any tensor fills the argument
        partial_out = partial_lse = out
    # The interpreter multiplies bf16 bits wrongly in tl.dot, so off-GPU everything is fp32; on a
    # GPU fp32 inputs ask for IEEE products (TF32 would cost ~3 decimal digits).
    dot_fp32 = not on_gpu or query.dtype == torch.float32

    row_scales = key_scales is not None
    if not row_scales:  # never read without ROW_SCALES; any tensor fills the arguments
        key_scales = value_scales = partial_lse

    grid = (num_tokens // plan.block_q + num_seqs, num_kv_heads * plan.head_blocks, plan.num_splits)
    paged_attention_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        out, partial_out, partial_lse, key_scales, value_scales,
        score_scale_log2, out_scale, num_seqs, plan.kv_split_len, sliding_window, float(soft_cap),
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_scales.stride(0), key_scales.stride(1), value_scales.stride(0), value_scales.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, GROUP_BLOCK=plan.group_block, HEAD_BLOCKS=plan.head_blocks,
        V_DIM=value_dim, V_DIM_PAD=value_pad,
        TAIL_DIM=tail_dim, TAIL_PAD=max(MIN_DOT_SIZE, triton.next_power_of_2(max(tail_dim, 1))),
        BLOCK_SIZE=block_size, BLOCK_Q=plan.block_q, TILE=plan.tile,
        NUM_SPLITS=plan.num_splits, DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        SOFT_CAP=soft_cap > 0, ROW_SCALES=row_scales,
    )
    if plan.num_splits > 1:
        merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_lse, out_scale,
            out.stride(0), out.stride(1),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            NUM_SPLITS=plan.num_splits, SPLITS_PAD=triton.next_power_of_2(plan.num_splits),
            HEAD_DIM=value_dim, HEAD_DIM_PAD=value_pad,
        )
    return out
