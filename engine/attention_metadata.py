"""Where this step's tokens sit in the paged KV cache: passed to the forward explicitly, never
through a global forward context.

    flattened batch:   | req0 q0 q1 q2 | req1 q0 | req2 q0 q1 |      T = 6 tokens
    query_start_loc:   0               3         4            6     [B+1]
    seq_lens:          context after this step, per request       [B]
    slot_mapping:      block_id * block_size + offset per token    [T]  (-1: padding, not written)
    block_tables:      request -> physical block ids, padded       [B, max_blocks]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    max_query_len: int
    max_seq_len: int

    def __post_init__(self) -> None:
        expected = {
            "slot_mapping": (self.slot_mapping, 1, torch.int64),
            "block_tables": (self.block_tables, 2, torch.int32),
            "seq_lens": (self.seq_lens, 1, torch.int32),
            "query_start_loc": (self.query_start_loc, 1, torch.int32),
        }
        for name, (tensor, ndim, dtype) in expected.items():
            if tensor.dim() != ndim or tensor.dtype != dtype:
                raise ValueError(f"AttentionMetadata.{name} must be a {ndim}-d {dtype} tensor, "
                                 f"got {tuple(tensor.shape)} {tensor.dtype}")
        num_seqs = self.seq_lens.shape[0]
        if self.block_tables.shape[0] != num_seqs or self.query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(
                f"AttentionMetadata: {num_seqs} seq_lens need {num_seqs} block-table rows and "
                f"{num_seqs + 1} query_start_loc entries, got {self.block_tables.shape[0]} and "
                f"{self.query_start_loc.shape[0]}"
            )
        if self.max_query_len < 1 or self.max_seq_len < self.max_query_len:
            raise ValueError(f"AttentionMetadata: need 1 <= max_query_len ({self.max_query_len}) <= "
                             f"max_seq_len ({self.max_seq_len})")

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_ids: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """From per-request lists: request i has seq_lens[i] tokens of context after this step, of
        which the last query_lens[i] are computed now, and its block table is block_ids[i]."""
        slots: list[int] = []
        for q_len, seq_len, blocks in zip(query_lens, seq_lens, block_ids, strict=True):
            if q_len < 1 or seq_len < q_len or len(blocks) * block_size < seq_len:
                raise ValueError(f"request with {q_len} queries, {seq_len} context and {len(blocks)} "
                                 f"blocks of {block_size} is inconsistent")
            slots += [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
        width = max(len(b) for b in block_ids)
        tables = [b + [0] * (width - len(b)) for b in block_ids]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
