"""Where this step's tokens sit in the paged KV cache: one object per step (per layer group),
passed whole to the attention backend by every layer, never through a global forward context.

    flattened batch:   | req0 q0 | req1 q0 | req2 q0 q1 q2 | req3 q0 q1 |   T = 7 tokens
                         decode    decode    prompt chunk    prompt chunk
    num_decodes:       2  (requests [0, 2) are single-token decodes, query rows [0, 2))
    query_start_loc:   0         1         2               5            7     [B+1]
    seq_lens:          context after this step, per request                    [B]
    slot_mapping:      block_id * block_size + offset per token                [T]  (-1: padding, not written)
    block_tables:      request -> physical block ids, padded with 0            [B, max_blocks]

The engine builds it (engine/attention_metadata.py: build_flat_batch) and checks it once per
step, so the backends need not re-read it in every layer; a backend's `prepare` then does its
per-step work once, before the first layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    max_query_len: int
    max_seq_len: int
    # Requests [0, num_decodes) are single-query decodes in query rows [0, num_decodes); the rest
    # are prompt chunks. Kernels use it to split the batch without reading the offsets.
    num_decodes: int
    # The layer group's sliding window w (query p sees keys p - w + 1 .. p; the blocks wholly
    # before a request's window are never read, their table entries may hold any id), or 0 for
    # full attention. An int, never None, so that a compiled layer keeps it symbolic: window and
    # global layers share one graph.
    sliding_window: int = 0
    # What the backend's per-step `prepare` attached (the Triton launch plans and buffers that
    # every layer of the step reuses); None before prepare, and for backends that need nothing.
    prepared: Any = field(default=None, compare=False, repr=False)

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
        if self.sliding_window < 0:
            raise ValueError(f"AttentionMetadata: sliding_window must be >= 0 (0: full attention), got {self.sliding_window}")
        if not 0 <= self.num_decodes <= num_seqs:
            raise ValueError(f"AttentionMetadata: num_decodes {self.num_decodes} is outside [0, {num_seqs}]")

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
