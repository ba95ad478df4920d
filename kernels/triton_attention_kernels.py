"""Triton programs for paged attention over a mixed batch (decode rows and prompt chunks).

One launch covers the whole batch. The grid is (query tiles, KV heads, KV splits):

    axis 0: query tile  -- BLOCK_Q consecutive query tokens of ONE request. Request s owns tiles
                           [start[s] // BLOCK_Q + s, start[s+1] // BLOCK_Q + s + 1); the tile count is
                           bounded by num_tokens // BLOCK_Q + num_seqs, known from shapes alone, so
                           the launcher never reads the offsets (no host sync). Tiles past the end of
                           a request exit at once.
    axis 1: KV head x head block -- the tile's rows are BLOCK_Q tokens x GROUP_BLOCK of the query
                           heads sharing this KV head, so each K/V tile is loaded once and used by
                           that many heads (the whole group unless it is large: latent attention's
                           128 heads on one KV head run in blocks, so the accumulator fits):

                               row r = token (r // GROUP_BLOCK),
                                       head kv_head * GROUP + head_block * GROUP_BLOCK + r % GROUP_BLOCK
                               Q tile [BLOCK_Q * GROUP_BLOCK, K_DIM] . K tile^T [K_DIM, TILE]

    axis 2: KV split    -- flash-decoding: split `split` covers context positions
                           [lo + split * kv_split_len, lo + (split + 1) * kv_split_len), lo = 0,
                           or with a sliding window w the tile's first query's window start. With one split the
                           program writes the output; otherwise it writes a normalised partial
                           result and its log2-sum-exp, and `_merge_splits_kernel` combines them.

K/V tiles are gathered through the block table per position, so TILE need not equal the block
size (tl.dot wants >= 16 on a GPU; blocks may be 8). Softmax runs online in base 2 with the
scale (and the fp8 k_scale) folded into one multiplier; a soft cap c (Gemma 2) turns each scaled
score s into c * tanh(s / c) first. An int8 cache (ROW_SCALES) is read with its per-row scales: a
key's scale multiplies its score column (before the cap), a value's its weight column of P (after
the row sums, before P.V), so the int8 tiles go to tl.dot as they are, converted only.

Keys may be wider than values (latent attention: 576-dim keys = the 512 latent values + a 64-dim
rope key). A key is read as two power-of-2 tiles, its first V_DIM dims and the TAIL_DIM past
them, and the scores are the sum of the two products: no padding 576 up to 1024.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_Q: tl.constexpr):
    """The last request s whose first tile index (start[s] // BLOCK_Q + s) is <= tile_index."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_index:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _soft_cap(scores, cap):
    """cap * tanh(scores / cap), with tanh from exp2 (the interpreter has no tanh): tanh|x| =
    (1 - e) / (1 + e), e = 2^(-2|x| log2 e) <= 1, never overflowing."""
    x = scores / cap
    magnitude = tl.abs(x)
    e = tl.exp2(magnitude * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t) * cap


@triton.jit
def paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, key_scales_ptr, value_scales_ptr,
    score_scale_log2, out_scale, num_seqs, kv_split_len, sliding_window, soft_cap,
    stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    stride_bt,
    stride_ot, stride_oh,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    V_DIM: tl.constexpr, V_DIM_PAD: tl.constexpr, TAIL_DIM: tl.constexpr, TAIL_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr,
    ROW_SCALES: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_BLOCK
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_tile = tile_index - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - q_len  # positions that precede this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_index = local_tile * BLOCK_Q + rows // GROUP_BLOCK
    group_member = head_block * GROUP_BLOCK + rows % GROUP_BLOCK
    head = kv_head * GROUP + group_member
    row_valid = (q_index < q_len) & (group_member < GROUP)
    q_pos = context_before + q_index
    dims = tl.arange(0, V_DIM_PAD)  # the values' dims, and the keys' first V_DIM
    dim_valid = dims < V_DIM
    tail = tl.arange(0, TAIL_PAD)  # the keys' dims past V_DIM (none unless TAIL_DIM > 0)
    tail_valid = tail < TAIL_DIM

    q_rows = query_ptr + (q_start + q_index)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if TAIL_DIM > 0:
        q_tail = tl.load(q_rows + V_DIM + tail[None, :], mask=row_valid[:, None] & tail_valid[None, :], other=0.0)
        q_tail = q_tail.to(q.dtype)

    # The last query of this tile sees positions < kv_stop; nothing after it is read.
    kv_stop = tl.minimum(seq_len, context_before + tl.minimum(local_tile * BLOCK_Q + BLOCK_Q, q_len))
    # A sliding window: the tile's first query sees nothing before kv_lo, so the splits start
    # there and the blocks before it are never read (a window group gives them back).
    window_start = tl.maximum(context_before + local_tile * BLOCK_Q - sliding_window + 1, 0)
    kv_lo = tl.where(sliding_window > 0, window_start, 0)
    kv_begin = kv_lo + split * kv_split_len
    kv_end = tl.minimum(kv_stop, kv_begin + kv_split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    for tile_start in range(kv_begin, kv_end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        pos_valid = positions < kv_end
        physical = tl.load(table_row + positions // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        offsets = positions % BLOCK_SIZE
        k_rows = key_cache_ptr + physical[:, None] * stride_kb + kv_head * stride_kh + offsets[:, None] * stride_ks
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_rows + dims[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE]
        if TAIL_DIM > 0:
            k_tail = tl.load(k_rows + V_DIM + tail[None, :], mask=pos_valid[:, None] & tail_valid[None, :], other=0.0)
            scores += tl.dot(q_tail, tl.trans(k_tail.to(q.dtype)), input_precision=DOT_PRECISION)
        if ROW_SCALES:  # int8: each key's scale multiplies its score
            k_row_scales = tl.load(key_scales_ptr + physical * stride_ksb + kv_head * stride_ksh + offsets, mask=pos_valid, other=0.0)
            scores = scores * k_row_scales[None, :]
        scores = scores * score_scale_log2  # log2 units (natural ones with a soft cap: the launcher leaves LOG2_E out)
        if SOFT_CAP:
            scores = _soft_cap(scores, soft_cap) * 1.4426950408889634  # log2(e)
        visible = (positions[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        visible = visible & ((sliding_window == 0) | (positions[None, :] > q_pos[:, None] - sliding_window))
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row may see nothing in this tile (causal edge, empty split): keep it NaN-free.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_offsets = physical[:, None] * stride_vb + kv_head * stride_vh + offsets[:, None] * stride_vs + dims[None, :]
        v = tl.load(value_cache_ptr + v_offsets, mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        if ROW_SCALES:  # int8: each value's scale multiplies its weight (the row sums above are unscaled)
            v_row_scales = tl.load(value_scales_ptr + physical * stride_vsb + kv_head * stride_vsh + offsets, mask=pos_valid, other=0.0)
            p = p * v_row_scales[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    normalised = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    token = q_start + q_index
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, (normalised * out_scale).to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part_ptrs = partial_out_ptr + split * stride_ps + token[:, None] * stride_pt + head[:, None] * stride_ph + dims[None, :]
        tl.store(part_ptrs, normalised, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        lse_ptrs = partial_lse_ptr + split * stride_ls + token * stride_lt + head
        tl.store(lse_ptrs, lse, mask=row_valid)


@triton.jit
def merge_splits_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, out_scale,
    stride_ot, stride_oh,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """One program per (token, head): the log-sum-exp-weighted mean of the splits' partial outputs."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(
        partial_lse_ptr + splits * stride_ls + token * stride_lt + head,
        mask=split_valid, other=float("-inf"),
    )
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, axis=0)
    parts = tl.load(
        partial_out_ptr + splits[:, None] * stride_ps + token * stride_pt + head * stride_ph + dims[None, :],
        mask=split_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0,
    )
    merged = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, (merged * out_scale).to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
