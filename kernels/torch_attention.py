"""Paged attention on the CPU: the serving entry point, and the plain-torch oracle.

`paged_attention` runs the C++ kernel of cpu_attention.py (reads K/V in place through the block
tables) where it can be built, else `torch_paged_attention`, the plain-torch implementation that
is also the oracle for the Triton and C++ kernels.

Cache layout (shared by every implementation):
    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim (of keys; of values)]
Keys and values may differ in width: latent attention (MLA, DeepSeek-V2/V3) reads one shared KV
head whose keys are 576-dim latent+rope vectors and whose values are their first 512 values, a
view of the same memory (`values_alias_keys`); such a cache is written once (the keys) and
gathered once. The output has the values' width.
An int8 cache comes with per-(token, KV head) float32 scales, `key_scales` / `value_scales`
[num_blocks, num_kv_heads, block_size] (kv_quant.py): written with each token, read back as
`stored * scale`.
A token at position p of a request lives in physical block block_table[p // block_size], row
p % block_size; its "slot" is block_id * block_size + p % block_size. Within one block and one
KV head the block_size x head_dim tile is contiguous, so a GPU program that owns a KV head reads
each block as one coalesced run of block_size * head_dim elements, and GQA heads sharing that KV
head reuse it from registers/shared memory.

How the mixed batch is computed by the torch implementation:
- decode rows (q_len == 1) go through one batched SDPA call: their block tables are gathered
  once, padded to the longest context and masked. On 2 CPU threads this beats a per-request loop
  from a handful of requests on (see benchmarks/attention_kernels.py).
- prompt chunks (q_len > 1) loop per request, which is fine: each one carries many tokens of work.
GQA never repeats K/V: a KV head's `group` query heads are folded into its query rows
([kv_heads, group * q_len, head_dim]), so every K/V row is read once per KV head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.cpu_attention import cpu_kernel_available, cpu_kernel_supports, cpu_paged_attention, cpu_write_kv_cache
from kvserve.kernels.kv_quant import check_int8_scales, check_scale, quantize_for_cache, quantize_rows_int8
from kvserve.kernels.validation import (
    check_attention_shapes,
    check_attention_values,
    check_num_decodes,
    check_write_shapes,
    check_write_values,
    values_alias_keys,
)

GATHER_BUDGET_BYTES = 4 << 20  # gathered K+V per decode slice: about an L2-sized working set


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 marks padding that is not written
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    key_scales: torch.Tensor | None = None,  # int8 caches: [num_blocks, num_kv_heads, block_size] float32
    value_scales: torch.Tensor | None = None,
    validate: bool = True,
) -> None:
    """Scatter this step's K/V rows into their slots, quantising for an fp8 or int8 cache (an
    int8 cache's rows write their scales too). `validate=False` skips the Python checks where
    the C++ kernel runs (it checks what it reads, before writing) and the slot range check
    elsewhere (an out-of-range slot still fails in torch's indexing)."""
    k_scale_value, v_scale_value = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    check_int8_scales(key_cache.dtype, k_scale_value, v_scale_value)
    on_kernel = key.device.type == "cpu" and key.shape[-1] == value.shape[-1] and cpu_kernel_available()
    if validate or not on_kernel:
        check_write_shapes(key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales)
    if validate:
        check_write_values(slot_mapping, key_cache)
    if on_kernel:
        try:
            cpu_write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale_value, v_scale_value,
                               key_scales, value_scales)
        except ValueError:
            # The kernel found bad input; the Python checks say what is wrong in kvserve's words.
            check_write_shapes(key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales)
            check_write_values(slot_mapping, key_cache)
            raise
        return
    _torch_write(key, value, key_cache, value_cache, slot_mapping, k_scale_value, v_scale_value, key_scales, value_scales)


def torch_write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """`write_kv_cache` in plain torch on any device, always validated: the oracle."""
    check_write_shapes(key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales)
    check_write_values(slot_mapping, key_cache)
    k_scale_value, v_scale_value = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    check_int8_scales(key_cache.dtype, k_scale_value, v_scale_value)
    _torch_write(key, value, key_cache, value_cache, slot_mapping, k_scale_value, v_scale_value, key_scales, value_scales)


def _torch_write(key, value, key_cache, value_cache, slot_mapping, k_scale: float, v_scale: float,
                 key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = key_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    if key_scales is not None:  # int8: each row with its own scale
        for rows, cache, scales in ((key[valid], key_cache, key_scales), (value[valid], value_cache, value_scales)):
            cache[blocks, :, offsets], scales[blocks, :, offsets] = quantize_rows_int8(rows)
        return
    key_cache[blocks, :, offsets] = quantize_for_cache(key[valid], key_cache.dtype, k_scale)
    if not values_alias_keys(key_cache, value_cache):  # a latent's values were written with it
        value_cache[blocks, :, offsets] = quantize_for_cache(value[valid], value_cache.dtype, v_scale)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int
    seq_lens: torch.Tensor,  # [num_seqs]: context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1]: request i's queries are rows [q[i], q[i+1])
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
    validate: bool = True,
) -> torch.Tensor:
    """Each request's queries are the last q_len positions of its seq_len-token context and
    attend causally to it (prefix hits and earlier chunks included). Returns [num_tokens,
    num_heads, the value cache's head_dim].

    `sliding_window` w > 0: the query at position p sees keys p - w + 1 .. p only, and blocks
    wholly before the window are never read (a window group gives them back: their table
    entries may hold any id, paging/single_type_manager.py). 0: full attention.

    `soft_cap` c > 0: every scaled score s becomes c * tanh(s / c) before the softmax (Gemma 2's
    attention-logit soft-capping); 0: none.

    `num_decodes`: requests [0, num_decodes) are single-query decodes in query rows
    [0, num_decodes), the rest prompt chunks. `validate=False` skips the metadata *value* checks
    and, where the C++ kernel runs, the Python shape checks too: the kernel checks every shape,
    block id and length it relies on (a few microseconds, against ~60 for the Python checks), and
    on its refusal the Python checks run to name the problem. The torch path always checks
    shapes; its indexing raises on a bad block id."""
    on_kernel = (query.device.type == "cpu" and query.dim() == 3 and cpu_kernel_supports(key_cache.shape[-1], value_cache.shape[-1])
                 and cpu_kernel_available())
    if validate or not on_kernel:
        check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, num_decodes,
                               key_scales, value_scales)
    else:  # the kernel does not read num_decodes, so it cannot refuse a wrong one
        check_num_decodes(num_decodes, seq_lens.shape[0], query.shape[0])
    if validate:
        check_attention_values(query, key_cache, block_tables, seq_lens, query_start_loc, num_decodes)
    # k_scale multiplies every score, v_scale every output row: fold them in, never touch the cache.
    k_scale_value, out_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    check_int8_scales(key_cache.dtype, k_scale_value, out_scale)
    score_scale = scale * k_scale_value
    if on_kernel:
        try:
            return cpu_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, score_scale,
                                       out_scale, sliding_window, soft_cap, key_scales, value_scales)
        except ValueError:
            # The kernel checked what it read and refused; the Python checks say what is wrong in kvserve's words.
            check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, num_decodes,
                                   key_scales, value_scales)
            check_attention_values(query, key_cache, block_tables, seq_lens, query_start_loc, num_decodes)
            raise
    return _torch_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, score_scale, out_scale,
                            max_query_len, max_seq_len, num_decodes, sliding_window, soft_cap,
                            _row_scales(key_scales, value_scales))


def torch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
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
) -> torch.Tensor:
    """`paged_attention` in plain torch on any device, always validated: the oracle."""
    check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, num_decodes,
                           key_scales, value_scales)
    check_attention_values(query, key_cache, block_tables, seq_lens, query_start_loc, num_decodes)
    k_scale_value, v_scale_value = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    check_int8_scales(key_cache.dtype, k_scale_value, v_scale_value)
    return _torch_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                            scale * k_scale_value, v_scale_value, max_query_len, max_seq_len, num_decodes, sliding_window,
                            soft_cap, _row_scales(key_scales, value_scales))


def check_soft_cap(soft_cap: float) -> float:
    if not soft_cap >= 0:  # NaN too
        raise ValueError(f"soft_cap must be >= 0 (0: no soft-capping), got {soft_cap}")
    return float(soft_cap)


def cap_scores_(scores: torch.Tensor, soft_cap: float) -> torch.Tensor:
    """scores <- soft_cap * tanh(scores / soft_cap), in place (0: unchanged)."""
    return scores.div_(soft_cap).tanh_().mul_(soft_cap) if soft_cap else scores


RowScales = tuple[torch.Tensor, torch.Tensor] | None  # an int8 cache's (key_scales, value_scales)


def _row_scales(key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> RowScales:
    return None if key_scales is None else (key_scales, value_scales)


def _torch_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    score_scale: float,
    out_scale: float,
    max_query_len: int | None,
    max_seq_len: int | None,
    num_decodes: int | None,
    window: int = 0,
    soft_cap: float = 0.0,
    row_scales: RowScales = None,
) -> torch.Tensor:
    if window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: full attention), got {window}")
    soft_cap = check_soft_cap(soft_cap)
    out = query.new_empty(*query.shape[:2], value_cache.shape[-1])
    num_seqs = seq_lens.shape[0]
    if query.shape[0] == 0:
        return out
    if max_query_len == 1 or num_decodes == num_seqs:  # a pure decode step: no need to read the offsets
        decode_seqs = torch.arange(num_seqs, device=query.device)
        _decode_batch(out, query, key_cache, value_cache, block_tables, seq_lens, decode_seqs, query_start_loc[:-1], score_scale, out_scale, max_seq_len, window, soft_cap,
                      row_scales)
        return out

    if num_decodes is None:  # find the decodes among the requests
        starts = query_start_loc.tolist()
        q_lens = [starts[i + 1] - starts[i] for i in range(num_seqs)]
        decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1]
        chunks = [i for i, q_len in enumerate(q_lens) if q_len > 1]
        decode_seqs = torch.tensor(decodes, dtype=torch.long, device=query.device)
        decode_rows = torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=query.device)
    else:  # the caller says: decodes first, in rows [0, num_decodes)
        starts = [*range(num_decodes), *query_start_loc[num_decodes:].tolist()]
        chunks = list(range(num_decodes, num_seqs))
        decode_seqs = decode_rows = torch.arange(num_decodes, device=query.device)
    if decode_seqs.numel():
        _decode_batch(out, query, key_cache, value_cache, block_tables, seq_lens, decode_seqs, decode_rows, score_scale, out_scale, None, window, soft_cap,
                      row_scales)
    lens = seq_lens.tolist() if chunks else []
    for i in chunks:
        if starts[i + 1] == starts[i]:
            continue  # a request with no tokens this step
        out[starts[i] : starts[i + 1]] = _chunk_attention(
            query[starts[i] : starts[i + 1]], key_cache, value_cache, block_tables[i], lens[i], score_scale, out_scale, window, soft_cap,
            row_scales,
        )
    return out


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., n] block ids -> [kv_heads, ..., n * block_size, head_dim] in `dtype` (one copy)."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    # Row (block * kv_heads + head) of the flattened cache is one head's block, a contiguous
    # block_size x head_dim tile. index_select copies whole tiles straight into kv-head-major
    # order, so the reshape below is free (measured 6x faster than advanced indexing through a
    # transposed view).
    if cache.stride(0) != num_kv_heads * block_size * head_dim:
        # A layer sharing its pages with larger ones (paging/kv_cache_spec.py) uses part of each
        # page: blocks are not adjacent, so gather whole blocks, then put the heads first.
        gathered = cache[block_ids.long()].movedim(-3, 0)  # [kv_heads, ..., n, block_size, D]
        return gathered.reshape(num_kv_heads, *block_ids.shape[:-1], block_ids.shape[-1] * block_size, head_dim).to(dtype)
    heads = torch.arange(num_kv_heads, device=cache.device).view(-1, *([1] * block_ids.dim()))
    rows = (block_ids.long().unsqueeze(0) * num_kv_heads + heads).flatten()
    gathered = cache.view(num_blocks * num_kv_heads, block_size, head_dim).index_select(0, rows)
    return gathered.view(num_kv_heads, *block_ids.shape[:-1], block_ids.shape[-1] * block_size, head_dim).to(dtype)


def _gather_keys_and_values(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor,
                            dtype: torch.dtype, row_scales: RowScales = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gathered; a latent cache once, its values a slice of the gathered keys; an int8
    cache's rows times their scales (gathered through the same block ids)."""
    if row_scales is not None:
        return tuple(  # type: ignore[return-value]
            (_gather_context(cache, block_ids, torch.float32) * _gather_context(scales.unsqueeze(-1), block_ids, torch.float32)).to(dtype)
            for cache, scales in ((key_cache, row_scales[0]), (value_cache, row_scales[1])))
    keys = _gather_context(key_cache, block_ids, dtype)
    if values_alias_keys(key_cache, value_cache):
        return keys, keys[..., : value_cache.shape[-1]]
    return keys, _gather_context(value_cache, block_ids, dtype)


def _decode_batch(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seqs: torch.Tensor,  # which sequences are decodes
    rows: torch.Tensor,  # their (single) query row each
    score_scale: float,
    out_scale: float,
    max_seq_len: int | None,
    window: int = 0,
    soft_cap: float = 0.0,
    row_scales: RowScales = None,
) -> None:
    num_kv_heads = key_cache.shape[1]
    longest = int(seq_lens[seqs].max()) if max_seq_len is None else max_seq_len
    if window:  # a decode reads its window's blocks only
        longest = min(longest, window + key_cache.shape[2] - 1)
    # Gathered K+V per request; batches whose gathered context would spill out of the CPU caches
    # run in slices (measured: one 50 MB gather was slower than a per-request loop).
    gathered_dims = key_cache.shape[3] + (0 if values_alias_keys(key_cache, value_cache) else value_cache.shape[3])
    per_request = num_kv_heads * longest * gathered_dims * query.element_size()
    slice_size = max(1, GATHER_BUDGET_BYTES // per_request)
    # Slices of similar lengths waste little on padding: sorted, each slice is padded only to its
    # own longest context (measured 2.4x faster than padding all to the batch's longest).
    order = torch.argsort(seq_lens[seqs])
    seqs, rows = seqs[order], rows[order]
    lens = seq_lens[seqs]
    slice_longest = lens[slice_size - 1 :: slice_size].tolist() + [int(lens[-1])]
    for index, first in enumerate(range(0, seqs.shape[0], slice_size)):
        last = first + slice_size
        _decode_slice(out, query, key_cache, value_cache, block_tables, lens[first:last], seqs[first:last],
                      rows[first:last], score_scale, out_scale, int(slice_longest[index]), window, soft_cap, row_scales)


def _decode_slice(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    seqs: torch.Tensor,
    rows: torch.Tensor,
    score_scale: float,
    out_scale: float,
    longest: int,
    window: int = 0,
    soft_cap: float = 0.0,
    row_scales: RowScales = None,
) -> None:
    num_kv_heads, block_size, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    lens = lens.long()
    # With a window, request i reads from block first[i] on (its query at lens - 1 sees keys from
    # lens - w on): at most ceil((w - 1) / B) + 1 blocks, whatever its length (`longest` is capped).
    first = (lens - window).clamp_(min=0) // block_size if window else torch.zeros_like(lens)
    num_blocks = min((longest + block_size - 1) // block_size, block_tables.shape[1])
    logical = first.unsqueeze(1) + torch.arange(num_blocks, device=query.device)  # [n, num_blocks]
    # Entries past a sequence's last block are padding (possibly -1): point them at block 0; the
    # length mask hides whatever they hold.
    in_use = logical < ((lens + block_size - 1) // block_size).unsqueeze(1)
    tables = block_tables[seqs].long().gather(1, logical.clamp(max=block_tables.shape[1] - 1))
    tables = torch.where(in_use, tables, torch.zeros_like(tables))
    k, v = _gather_keys_and_values(key_cache, value_cache, tables, query.dtype, row_scales)  # [kv_heads, n, L, D (Dv)]
    q = query[rows].view(-1, num_kv_heads, group, head_dim).transpose(0, 1)  # [kv_heads, n, group, D]
    key_positions = (first * block_size).unsqueeze(1) + torch.arange(k.shape[2], device=query.device)  # [n, L]
    hidden = key_positions >= lens.unsqueeze(1)  # padding
    if window:
        hidden |= key_positions < (lens - window).unsqueeze(1)  # before the window
    # Two batched matmuls rather than SDPA: with a single query row per request, CPU SDPA's
    # flash kernel spends its time on tiling overhead (measured 2x slower at 64 x 208 tokens).
    # The softmax runs in float32 whatever the cache dtype.
    scores = cap_scores_(torch.matmul(q, k.transpose(-1, -2)).float().mul_(score_scale), soft_cap)  # [kv_heads, n, group, L]
    scores.masked_fill_(hidden[None, :, None, :], float("-inf"))
    attn = torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
    if out_scale != 1.0:
        attn = attn * out_scale
    out[rows] = attn.transpose(0, 1).reshape(-1, num_heads, v.shape[-1])


def _chunk_attention(
    q: torch.Tensor,  # [q_len, num_heads, D]: the last q_len positions of the context
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    score_scale: float,
    out_scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
    row_scales: RowScales = None,
) -> torch.Tensor:
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    # With a window, the chunk's first query (at seq_len - q_len) reads from seq_len - q_len - w + 1
    # on: the blocks before that one are not read.
    first_block = max(0, seq_len - q_len - window + 1) // block_size if window else 0
    base = first_block * block_size  # the first gathered key's position
    blocks = block_table[first_block: (seq_len + block_size - 1) // block_size]
    k, v = _gather_keys_and_values(key_cache, value_cache, blocks, q.dtype, row_scales)
    k, v = k[:, :seq_len - base], v[:, :seq_len - base]  # [kv_heads, seq_len - base, D (Dv)]
    # Fold each KV head's group of query heads into its rows: row g * q_len + t is head g, token t.
    q_rows = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
    if group == 1 and q_len == seq_len and not 0 < window < seq_len and not soft_cap:
        attn = F.scaled_dot_product_attention(q_rows, k, v, is_causal=True, scale=score_scale)
    else:
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device).repeat(group).unsqueeze(1)
        keys = torch.arange(base, seq_len, device=q.device).unsqueeze(0)
        visible = keys <= positions
        if window:
            visible &= keys > positions - window
        if soft_cap:  # SDPA cannot cap its scores: the two products, the cap and the softmax spelled out, in fp32
            scores = cap_scores_(torch.matmul(q_rows, k.transpose(-1, -2)).float().mul_(score_scale), soft_cap)
            attn = torch.matmul(scores.masked_fill_(~visible, float("-inf")).softmax(dim=-1).to(v.dtype), v)
        else:
            attn = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=visible, scale=score_scale)
    if out_scale != 1.0:
        attn = attn * out_scale
    value_dim = v.shape[-1]
    return attn.view(num_kv_heads, group, q_len, value_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, value_dim)
