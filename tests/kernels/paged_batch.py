"""Builds random mixed batches in the paged layout, and the dense answer they must give.

Each request's K/V is scattered into a shuffled set of physical blocks (never contiguous, never
in order), block-table entries past a request's last block hold -1, and the dense reference runs
`scaled_dot_product_attention` with an explicit causal mask on the unpaged K/V of each request.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels import FP8_KV_DTYPE


@dataclass(frozen=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    dense_keys: list[torch.Tensor]  # per request [seq_len, kv_heads, head_dim], as stored (dequantised)
    dense_values: list[torch.Tensor]
    scale: float

    def attention_args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.query_start_loc, self.scale)


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    kv_scale: float = 1.0,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    assert all(1 <= q <= s for q, s in zip(query_lens, seq_lens, strict=True))
    generator = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold garbage nobody may read
    physical = torch.randperm(num_blocks, generator=generator)
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=generator).to(kv_dtype)
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=generator).to(kv_dtype)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    dense_keys, dense_values = [], []
    used = 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = physical[used : used + n]
        used += n
        block_tables[i, :n] = ids
        # Values the cache holds: scale * (x / scale rounded to the cache dtype).
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator) * kv_scale
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator) * kv_scale
        k_stored, v_stored = (k / kv_scale).to(kv_dtype), (v / kv_scale).to(kv_dtype)
        positions = torch.arange(seq_len)
        key_cache[ids[positions // block_size], :, positions % block_size] = k_stored
        value_cache[ids[positions // block_size], :, positions % block_size] = v_stored
        dense_keys.append(k_stored.float() * kv_scale)
        dense_values.append(v_stored.float() * kv_scale)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        query=query.to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        dense_keys=dense_keys,
        dense_values=dense_values,
        scale=head_dim**-0.5,
    )


def dense_attention(batch: PagedBatch, sliding_window: int = 0, soft_cap: float = 0.0) -> torch.Tensor:
    """fp32 SDPA per request on contiguous K/V (GQA by repeating heads), causal mask aligned to
    the end of the context (and, with a sliding window w, keys within w - 1 of the query; with a
    soft cap c, scores s as c * tanh(s / c), spelled out). Returns [num_tokens, num_heads,
    head_dim] in float32 on the CPU."""
    query = batch.query.float().cpu()
    starts = batch.query_start_loc.tolist()
    group = query.shape[1] // batch.dense_keys[0].shape[1]
    outputs = []
    for i, (k, v) in enumerate(zip(batch.dense_keys, batch.dense_values, strict=True)):
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)  # [heads, q_len, D]
        q_len, seq_len = q.shape[1], k.shape[0]
        keys = k.transpose(0, 1).repeat_interleave(group, dim=0)
        values = v.transpose(0, 1).repeat_interleave(group, dim=0)
        keys_at, queries_at = torch.arange(seq_len).unsqueeze(0), torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        causal = keys_at <= queries_at
        if sliding_window:
            causal &= keys_at > queries_at - sliding_window
        if soft_cap:
            scores = soft_cap * torch.tanh(q @ keys.transpose(-1, -2) * batch.scale / soft_cap)
            out = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ values
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal, scale=batch.scale)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


# Tolerances per query dtype, against the fp32 dense answer on the same stored K/V. bf16 keeps 8
# mantissa bits (eps 2^-7) and the interpreter truncates fp32 -> bf16 instead of rounding.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}

# The mixed batch of the issue: every required context length, chunks of 1/5/16 next to decodes.
MIXED_SEQ_LENS = [1, 15, 16, 17, 33, 200, 200]
MIXED_QUERY_LENS = [1, 5, 16, 1, 5, 1, 16]

# The same requests ordered as the engine orders a step when it passes `num_decodes`: the
# single-query decodes first (query rows [0, 3)), then the prompt chunks.
DECODES_FIRST_SEQ_LENS = [1, 17, 200, 15, 16, 33, 200]
DECODES_FIRST_QUERY_LENS = [1, 1, 1, 5, 16, 5, 16]
NUM_DECODES = 3

FP8 = FP8_KV_DTYPE


def poison_outside_window(batch: PagedBatch, sliding_window: int) -> PagedBatch:
    """Points every block-table entry wholly before a request's window (as of its first query)
    at a block of NaNs, as a window group's given-back blocks may hold anything: a kernel that
    reads one, even masked, returns NaN."""
    key_cache, value_cache, tables = batch.key_cache.clone(), batch.value_cache.clone(), batch.block_tables.clone()
    poisoned = min(set(range(key_cache.shape[0])) - set(tables.flatten().tolist()))  # a spare block (make_batch leaves 3)
    key_cache[poisoned] = float("nan")
    value_cache[poisoned] = float("nan")
    block_size = key_cache.shape[2]
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        first_query = seq_len - (starts[i + 1] - starts[i])
        tables[i, : max(0, first_query - sliding_window + 1) // block_size] = poisoned
    return dataclasses.replace(batch, key_cache=key_cache, value_cache=value_cache, block_tables=tables)


def make_latent_batch(seq_lens: list[int], query_lens: list[int], *, kv_lora_rank: int = 32, rope_dim: int = 16,
                      num_heads: int = 4, **options) -> PagedBatch:
    """A latent (MLA) cache: one shared KV head of kv_lora_rank + rope_dim dims per token, whose
    values are its first kv_lora_rank dims, a view of the same memory (as the runner lays it out)."""
    batch = make_batch(seq_lens, query_lens, num_kv_heads=1, group=num_heads, head_dim=kv_lora_rank + rope_dim, **options)
    return dataclasses.replace(
        batch,
        value_cache=batch.key_cache[..., :kv_lora_rank],
        dense_values=[k[..., :kv_lora_rank] for k in batch.dense_keys],
    )
