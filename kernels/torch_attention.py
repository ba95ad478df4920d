"""Paged attention in plain torch: the CPU path and the test oracle for the Triton kernels.

Cache layout (shared by every implementation):
    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]
A token at position p of a request lives in physical block block_table[p // block_size], row
p % block_size. Its "slot" is block_id * block_size + p % block_size.
"""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 marks padding that is not written
) -> None:
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[valid].to(value_cache.dtype)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int
    seq_lens: torch.Tensor,  # [num_seqs]: context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1]: request i's queries are rows [q[i], q[i+1])
    scale: float,
) -> torch.Tensor:
    """Each request's queries are the last q_len positions of its seq_len-token context and
    attend causally to it (prefix hits and earlier chunks included)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q = query[starts[i] : starts[i + 1]]
        q_len = q.shape[0]
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        # [num_blocks, kv_heads, block_size, D] -> [kv_heads, seq_len, D]
        k = key_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
        v = value_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
        k = k.repeat_interleave(group, dim=0).to(query.dtype)
        v = v.repeat_interleave(group, dim=0).to(query.dtype)
        scores = torch.einsum("qhd,hkd->hqk", q.float(), k.float()) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,hkd->qhd", probs, v.float()).to(query.dtype)
    return out
