"""Per-request token counts for the penalties, kept on the device across steps.

Presence and frequency penalties need how often each vocabulary token occurs in a request's
output; the repetition penalty also needs which tokens occur in its prompt. Rebuilding those
[rows, vocab] tensors from the token lists at every step costs Python work proportional to all
tokens so far (quadratic over a request's life). Here each request keeps its own count vector,
and a step adds only the tokens appended since the previous one (normally one).

An entry lives as long as the runner holds the request (the runner drops it with `remove` when
the scheduler reports the request finished), so a request paused by a preemption keeps its
counts. It is also tied to the identity of the runner's output list for the request, so an id
reused by a new request can never inherit old counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvserve.engine.sampling.sampling_batch import PenaltyRows


@dataclass(frozen=True)
class Penalties:
    """The penalty tensors for a set of logits rows, one row each."""

    output_counts: Tensor  # [P, V] float32: how often each token occurs in each row's output
    seen: Tensor  # [P, V] bool: token occurs in the row's output, or in its prompt (repetition only)
    presence: Tensor  # [P, 1] float32
    frequency: Tensor  # [P, 1] float32
    repetition: Tensor  # [P, 1] float32


@dataclass
class _Entry:
    output_token_ids: list[int]  # the runner's list for the request (identity marks the request)
    num_counted: int
    counts: Tensor  # [V] float32
    prompt_seen: Tensor | None  # [V] bool, only when the repetition penalty is on


class TokenCounts:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def penalties(self, rows: PenaltyRows, vocab_size: int) -> Penalties:
        entries = {}
        for request in rows.requests:
            entry = self._entries.get(request.request_id)
            tokens = request.output_token_ids
            if entry is None or entry.output_token_ids is not tokens or entry.num_counted > len(tokens):
                entry = self._new_entry(request.prompt_token_ids, tokens,
                                        request.sampling_params.repetition_penalty != 1, vocab_size, rows.rows.device)
            elif entry.num_counted < len(tokens):
                _add(entry.counts, tokens[entry.num_counted:])
                entry.num_counted = len(tokens)
            entries[request.request_id] = entry
        self._entries.update(entries)
        ordered = [entries[r.request_id] for r in rows.requests]
        counts = torch.stack([e.counts for e in ordered])
        seen = counts > 0
        for i, entry in enumerate(ordered):
            if entry.prompt_seen is not None:
                seen[i] |= entry.prompt_seen
        return Penalties(counts, seen, rows.presence, rows.frequency, rows.repetition)

    def remove(self, request_ids: list[str]) -> None:
        """Forget finished requests."""
        for request_id in request_ids:
            self._entries.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _new_entry(prompt: list[int], output: list[int], with_prompt: bool, vocab_size: int,
                   device: torch.device) -> _Entry:
        counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        _add(counts, output)
        prompt_seen = None
        if with_prompt:
            prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            prompt_seen[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
        return _Entry(output, len(output), counts, prompt_seen)


def _add(counts: Tensor, token_ids: list[int]) -> None:
    if token_ids:
        index = torch.tensor(token_ids, dtype=torch.int64, device=counts.device)
        counts.index_put_((index,), torch.ones(len(token_ids), device=counts.device), accumulate=True)
