"""The per-step sampling parameters of a batch, gathered once into tensors.

Building this is the only place that walks the requests one by one (reading their parameters
into lists); everything the sampler does afterwards is tensor work on the rows concerned.
Features no row uses are left as None so the sampler skips them entirely (most batches use none
of the penalties, bias or min_tokens, and greedy rows need nothing but an argmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from kvserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.input_batch import CachedRequestState

_MASK_32 = 0xFFFFFFFF
# Below this temperature a row is sampled greedily: dividing by it would overflow float32 logits.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SparseLogitUpdate:
    """Values to write (or add) at (row, token) positions of the logits."""

    rows: Tensor  # [N] int64
    tokens: Tensor  # [N] int64
    values: Tensor  # [N] float32


@dataclass(frozen=True)
class RandomRows:
    """What the rows that draw (not greedy) need, indexed by their position among those rows."""

    rows: Tensor  # [R] int64: their indices in the batch
    temperature: Tensor  # [R] float32
    top_k: Tensor | None  # [R] int64, 0 = off; None when no row uses top-k
    top_p: Tensor | None  # [R] float32, 1.0 = off
    min_p: Tensor | None  # [R] float32, 0.0 = off
    # A seeded row's random numbers depend only on (seed, step): the batch around it never matters.
    seed_lo: Tensor  # [R] int64, low 32 bits of the seed
    seed_hi: Tensor  # [R] int64, next 32 bits
    step: Tensor  # [R] int64: output tokens generated so far (unchanged by preemption/recompute)


@dataclass(frozen=True)
class PenaltyRows:
    """The rows with a presence, frequency or repetition penalty. Their token counts are kept by
    the Sampler across steps (TokenCounts), so the batch carries only references to the tokens."""

    rows: Tensor  # [P] int64: their indices in the batch
    requests: list[CachedRequestState]
    presence: Tensor  # [P, 1] float32
    frequency: Tensor  # [P, 1] float32
    repetition: Tensor  # [P, 1] float32


@dataclass(frozen=True)
class SamplingBatch:
    """The rows that sample this step, in batch order (one logits row each). Every stage of the
    sampler touches only the rows that ask for it: greedy rows are an argmax and nothing else."""

    num_rows: int
    vocab_size: int
    random: RandomRows | None  # None when every row is greedy
    logit_bias: SparseLogitUpdate | None
    banned: SparseLogitUpdate | None  # min_tokens: EOS/stop tokens forced to -inf
    penalties: PenaltyRows | None
    num_logprobs: list[int | None]  # per row: None, or how many top alternatives to return
    logprob_rows: Tensor | None  # int64 indices of the rows that want logprobs
    max_num_logprobs: int

    @property
    def is_plain_greedy(self) -> bool:
        """Every row takes the argmax of its raw logits: nothing draws, nothing changes a logit,
        nobody wants logprobs."""
        return (self.random is None and self.logit_bias is None and self.banned is None
                and self.penalties is None and self.logprob_rows is None)

    @classmethod
    def from_requests(cls, requests: Sequence[CachedRequestState], vocab_size: int, eos_token_ids: tuple[int, ...],
                      device: torch.device, draft_offsets: Sequence[int] | None = None) -> "SamplingBatch":
        """Requests whose `samples` is false this step (mid-prompt chunks) are skipped: rows
        correspond to the requests that sample, in order. One pass over the rows sorts them by what they ask
        for; the per-row work does not depend on the vocabulary or on the tokens so far.

        `draft_offsets`: with speculative decoding a request samples one row per draft position
        (it repeats in `requests`); row i then stands `draft_offsets[i]` tokens past the
        request's outputs, which is what its random number and min_tokens see."""
        rows = [r for r in requests if r.samples]
        offsets = list(draft_offsets) if draft_offsets is not None else [0] * len(rows)
        if len(offsets) != len(rows):
            raise ValueError(f"{len(offsets)} draft offsets for {len(rows)} sampling rows")
        random_rows: list[int] = []
        penalty_rows: list[int] = []
        num_logprobs: list[int | None] = []
        for i, r in enumerate(rows):
            p = r.sampling_params
            if not (p.is_greedy or p.temperature < GREEDY_TEMPERATURE):
                random_rows.append(i)
            if p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1:
                if offsets[i]:
                    raise ValueError(f"request {r.request_id!r} has penalties and drafts: its counts cannot follow "
                                     "draft positions (the drafter gives penalised requests none)")
                penalty_rows.append(i)
            num_logprobs.append(p.logprobs)
        logprob_rows = [i for i, n in enumerate(num_logprobs) if n is not None]
        params = [r.sampling_params for r in rows]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            random=_random_rows([rows[i] for i in random_rows], [offsets[i] for i in random_rows], random_rows,
                                vocab_size, device) if random_rows else None,
            logit_bias=_logit_bias(params, device),
            banned=_min_tokens_bans(rows, offsets, eos_token_ids, device),
            penalties=_penalty_rows([rows[i] for i in penalty_rows], penalty_rows, device) if penalty_rows else None,
            num_logprobs=num_logprobs,
            logprob_rows=torch.tensor(logprob_rows, dtype=torch.int64, device=device) if logprob_rows else None,
            max_num_logprobs=max((n for n in num_logprobs if n is not None), default=0),
        )


def _random_rows(rows: list[CachedRequestState], offsets: list[int], indices: list[int], vocab_size: int,
                 device: torch.device) -> RandomRows:
    params = [r.sampling_params for r in rows]

    def tensor(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    top_k = [p.top_k if p.top_k < vocab_size else 0 for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    seeds = [r.seed & ((1 << 64) - 1) for r in rows]
    return RandomRows(
        rows=tensor(indices, torch.int64),
        temperature=tensor([p.temperature for p in params], torch.float32),
        top_k=tensor(top_k, torch.int64) if any(top_k) else None,
        top_p=tensor(top_p, torch.float32) if any(v < 1.0 for v in top_p) else None,
        min_p=tensor(min_p, torch.float32) if any(v > 0.0 for v in min_p) else None,
        seed_lo=tensor([s & _MASK_32 for s in seeds], torch.int64),
        seed_hi=tensor([(s >> 32) & _MASK_32 for s in seeds], torch.int64),
        step=tensor([(len(r.output_token_ids) + offset) & _MASK_32 for r, offset in zip(rows, offsets)], torch.int64),
    )


def _penalty_rows(rows: list[CachedRequestState], indices: list[int], device: torch.device) -> PenaltyRows:
    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    params = [r.sampling_params for r in rows]
    return PenaltyRows(torch.tensor(indices, dtype=torch.int64, device=device), rows,
                       column([p.presence_penalty for p in params]), column([p.frequency_penalty for p in params]),
                       column([p.repetition_penalty for p in params]))


def _logit_bias(params: list[SamplingParams], device: torch.device) -> SparseLogitUpdate | None:
    entries = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias.items()]
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    return SparseLogitUpdate(torch.tensor(rows, dtype=torch.int64, device=device),
                             torch.tensor(tokens, dtype=torch.int64, device=device),
                             torch.tensor(values, dtype=torch.float32, device=device))


def _min_tokens_bans(rows: list[CachedRequestState], offsets: list[int], eos_token_ids: tuple[int, ...],
                     device: torch.device) -> SparseLogitUpdate | None:
    """While a row has fewer than min_tokens outputs, its stop tokens cannot be drawn. EOS is
    (every EOS id) banned too unless ignore_eos (then EOS does not stop the request, so it need not be held back)."""
    entries: list[tuple[int, int]] = []
    for i, (r, offset) in enumerate(zip(rows, offsets)):
        p = r.sampling_params
        if len(r.output_token_ids) + offset >= p.min_tokens:
            continue
        entries.extend((i, t) for t in p.stop_token_ids)
        if not p.ignore_eos:
            entries.extend((i, t) for t in eos_token_ids)
    if not entries:
        return None
    row_ids, tokens = zip(*entries)
    return SparseLogitUpdate(torch.tensor(row_ids, dtype=torch.int64, device=device),
                             torch.tensor(tokens, dtype=torch.int64, device=device),
                             torch.full((len(entries),), float("-inf"), dtype=torch.float32, device=device))
