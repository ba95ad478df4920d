"""Where this step's tokens sit in the paged KV cache: passed to the forward explicitly, never
through a global forward context. Built once per step (here, vectorised), read by every layer.

    flattened batch:   | req0 q0 | req1 q0 | req2 q0 q1 q2 | req3 q0 q1 |   T = 7 tokens
                         decode    decode    prompt chunk    prompt chunk
    num_decodes:       2  (requests [0, 2) are single-token decodes, query rows [0, 2))
    query_start_loc:   0         1         2               5            7     [B+1]
    seq_lens:          context after this step, per request                    [B]
    positions:         num_computed[i] .. seq_lens[i]-1 per request, end to end [T]
    slot_mapping:      block_id * block_size + offset per token                [T]  (-1: padding, not written)
    block_tables:      request -> physical block ids, padded with 0            [B, max_blocks]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
        if not 0 <= self.num_decodes <= num_seqs:
            raise ValueError(f"AttentionMetadata: num_decodes {self.num_decodes} is outside [0, {num_seqs}]")

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass(frozen=True)
class FlatBatch:
    """One step's requests laid end to end: each token's position, and the attention metadata."""

    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata


def build_flat_batch(query_lens: Sequence[int], num_computed: Sequence[int], block_ids: Sequence[Sequence[int]],
                     block_size: int, device: torch.device | str = "cpu") -> FlatBatch:
    """The one builder of positions and slots (runner, tests and benchmarks all use it).

    Request i computes query_lens[i] tokens at positions num_computed[i] onwards, and its block
    table is block_ids[i]. The order is the caller's: leading single-token requests count as
    decodes (the runner puts them first). Checked here, once per step, so that the layers need not.
    """
    num_seqs = len(query_lens)
    if not num_seqs or len(num_computed) != num_seqs or len(block_ids) != num_seqs:
        raise ValueError(f"need one query length, computed count and block table per request, got "
                         f"{num_seqs}, {len(num_computed)} and {len(block_ids)}")
    q_lens = np.asarray(query_lens, dtype=np.int64)
    computed = np.asarray(num_computed, dtype=np.int64)
    seq_lens = computed + q_lens
    table_lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=num_seqs)
    bad = np.flatnonzero((q_lens < 1) | (computed < 0) | (table_lens * block_size < seq_lens))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"request {i} with {q_lens[i]} queries after {computed[i]} computed tokens and "
                         f"{table_lens[i]} blocks of {block_size} is inconsistent")

    block_tables = np.zeros((num_seqs, int(table_lens.max())), dtype=np.int64)
    for i, blocks in enumerate(block_ids):  # one Python iteration per request, none per token
        block_tables[i, : len(blocks)] = blocks
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    # Token t belongs to request r = request_of_token[t] and sits at position
    # computed[r] + (t - query_start_loc[r]); its slot is found through r's block table.
    request_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = computed[request_of_token] + (np.arange(num_tokens) - query_start_loc[request_of_token])
    slot_mapping = block_tables[request_of_token, positions // block_size] * block_size + positions % block_size
    not_decode = np.flatnonzero(q_lens != 1)
    num_decodes = int(not_decode[0]) if not_decode.size else num_seqs

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        slot_mapping=tensor(slot_mapping, torch.int64),
        block_tables=tensor(block_tables, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        query_start_loc=tensor(query_start_loc, torch.int32),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        num_decodes=num_decodes,
    )
    return FlatBatch(positions=tensor(positions, torch.int64), attn_metadata=meta)
