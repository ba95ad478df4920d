"""Builds one step's flat batch: each token's position, and the attention metadata
(kernels/attention_metadata.py) of each layer group. Built once per step (here, vectorised), read
by every layer.

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

from kvserve.kernels import AttentionMetadata


@dataclass(frozen=True)
class FlatBatch:
    """One step's requests laid end to end: each token's position, and the attention metadata of
    each layer group (they share everything but their block tables and slots)."""

    positions: torch.Tensor  # [T] int64
    group_metadata: tuple[AttentionMetadata, ...]

    def layer_metadata(self, group_of_layer: Sequence[int]) -> list[AttentionMetadata]:
        """One metadata per layer: its group's."""
        return [self.group_metadata[group] for group in group_of_layer]


def build_flat_batch(query_lens: Sequence[int], num_computed: Sequence[int],
                     group_block_ids: Sequence[Sequence[Sequence[int | None]]], block_size: int,
                     device: torch.device | str = "cpu", group_windows: Sequence[int] | None = None) -> FlatBatch:
    """The one builder of positions and slots (runner, tests and benchmarks all use it).

    Request i computes query_lens[i] tokens at positions num_computed[i] onwards, and its block
    table in layer group g is group_block_ids[g][i]; group g's layers attend within a sliding
    window of group_windows[g] positions (0 or None: full attention), and its tables may hold
    None for the blocks given back before the window (read as block 0, which no kernel reads
    there). The order is the caller's: leading
    single-token requests count as decodes (the runner puts them first). Checked here, once per
    step, so that the layers need not.
    """
    num_seqs = len(query_lens)
    if not num_seqs or len(num_computed) != num_seqs or not group_block_ids or any(len(g) != num_seqs for g in group_block_ids):
        raise ValueError(f"need one query length, computed count and block table (in each layer group) per request, "
                         f"got {num_seqs}, {len(num_computed)} and {[len(g) for g in group_block_ids]}")
    q_lens = np.asarray(query_lens, dtype=np.int64)
    computed = np.asarray(num_computed, dtype=np.int64)
    seq_lens = computed + q_lens
    bad = np.flatnonzero((q_lens < 1) | (computed < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"request {i} with {q_lens[i]} queries after {computed[i]} computed tokens is inconsistent")
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    # Token t belongs to request r = request_of_token[t] and sits at position
    # computed[r] + (t - query_start_loc[r]); its slot is found through r's block table.
    request_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = computed[request_of_token] + (np.arange(num_tokens) - query_start_loc[request_of_token])
    not_decode = np.flatnonzero(q_lens != 1)
    num_decodes = int(not_decode[0]) if not_decode.size else num_seqs

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    shared = {
        "seq_lens": tensor(seq_lens, torch.int32),
        "query_start_loc": tensor(query_start_loc, torch.int32),
        "max_query_len": int(q_lens.max()),
        "max_seq_len": int(seq_lens.max()),
        "num_decodes": num_decodes,
    }
    metadata = []
    windows = list(group_windows) if group_windows is not None else [0] * len(group_block_ids)
    if len(windows) != len(group_block_ids):
        raise ValueError(f"need one window per layer group, got {len(windows)} for {len(group_block_ids)} groups")
    for block_ids, window in zip(group_block_ids, windows):
        block_tables, slot_mapping = _tables_and_slots(block_ids, seq_lens, request_of_token, positions, block_size)
        metadata.append(AttentionMetadata(slot_mapping=tensor(slot_mapping, torch.int64),
                                          block_tables=tensor(block_tables, torch.int32), sliding_window=window or 0,
                                          **shared))
    return FlatBatch(positions=tensor(positions, torch.int64), group_metadata=tuple(metadata))


def _tables_and_slots(block_ids: Sequence[Sequence[int | None]], seq_lens: np.ndarray, request_of_token: np.ndarray,
                      positions: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer group's block tables, padded with 0, and each token's slot through them."""
    num_seqs = len(block_ids)
    table_lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=num_seqs)
    short = np.flatnonzero(table_lens * block_size < seq_lens)
    if short.size:
        i = int(short[0])
        raise ValueError(f"request {i} reaches position {seq_lens[i] - 1} but its table holds {table_lens[i]} "
                         f"blocks of {block_size}")
    block_tables = np.zeros((num_seqs, int(table_lens.max())), dtype=np.int64)
    for i, blocks in enumerate(block_ids):  # one Python iteration per request, none per token
        if blocks and blocks[0] is None:  # a window group's given-back prefix (only ever a prefix)
            blocks = [0 if block is None else block for block in blocks]
        block_tables[i, : len(blocks)] = blocks
    slot_mapping = block_tables[request_of_token, positions // block_size] * block_size + positions % block_size
    return block_tables, slot_mapping
