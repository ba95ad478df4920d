"""The per-step sampling parameters of a batch, gathered once into tensors.

Building this is the only place that walks the requests one by one (reading their parameters
into lists); everything the sampler does afterwards is whole-batch tensor work. Features no row
uses are left as None so the sampler skips them entirely (most batches use none of the
penalties, bias or min_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from kvserve.scheduler.output import ScheduledRequest
from kvserve.scheduler.sampling_params import SamplingParams, SamplingParamsError

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
class Penalties:
    """Presence/frequency (over output tokens) and repetition (over prompt + output) penalties."""

    output_counts: Tensor  # [B, V] float32: how often each token occurs in each row's output
    seen: Tensor  # [B, V] bool: token occurs in the row's prompt or output
    presence: Tensor  # [B, 1] float32
    frequency: Tensor  # [B, 1] float32
    repetition: Tensor  # [B, 1] float32


@dataclass(frozen=True)
class SamplingBatch:
    """Tensors for the rows that sample this step, in batch order (one logits row each)."""

    num_rows: int
    vocab_size: int
    random_rows: Tensor | None  # int64 indices of the rows that sample; None when all are greedy
    temperature: Tensor  # [B] float32 (1.0 on greedy rows, where it is unused)
    top_k: Tensor | None  # [B] int64, 0 = off; None when no row uses top-k
    top_p: Tensor | None  # [B] float32, 1.0 = off
    min_p: Tensor | None  # [B] float32, 0.0 = off
    # A seeded row's random numbers depend only on (seed, step): the batch around it never matters.
    seed_lo: Tensor  # [B] int64, low 32 bits of the seed
    seed_hi: Tensor  # [B] int64, next 32 bits
    step: Tensor  # [B] int64: output tokens generated so far (unchanged by preemption/recompute)
    logit_bias: SparseLogitUpdate | None
    banned: SparseLogitUpdate | None  # min_tokens: EOS/stop tokens forced to -inf
    penalties: Penalties | None
    num_logprobs: list[int | None]  # per row: None, or how many top alternatives to return
    logprob_rows: Tensor | None  # int64 indices of the rows that want logprobs
    max_num_logprobs: int

    @classmethod
    def from_requests(cls, requests: Sequence[ScheduledRequest], vocab_size: int, eos_token_ids: tuple[int, ...],
                      device: torch.device) -> "SamplingBatch":
        """Requests whose `samples` is false (mid-prompt chunks) are skipped: rows correspond to
        the requests that sample, in order."""
        rows = [r for r in requests if r.samples]
        params = [r.sampling_params for r in rows]
        for p in params:
            check_token_ids_in_vocab(p, vocab_size)

        def tensor(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.is_greedy or p.temperature < GREEDY_TEMPERATURE for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        top_k = [p.top_k if p.top_k < vocab_size else 0 for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        seeds = [r.seed & ((1 << 64) - 1) for r in rows]
        num_logprobs = [p.logprobs for p in params]
        logprob_rows = [i for i, n in enumerate(num_logprobs) if n is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            random_rows=tensor(random_rows, torch.int64) if random_rows else None,
            temperature=tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32),
            top_k=tensor(top_k, torch.int64) if any(top_k) else None,
            top_p=tensor(top_p, torch.float32) if any(v < 1.0 for v in top_p) else None,
            min_p=tensor(min_p, torch.float32) if any(v > 0.0 for v in min_p) else None,
            seed_lo=tensor([s & _MASK_32 for s in seeds], torch.int64),
            seed_hi=tensor([(s >> 32) & _MASK_32 for s in seeds], torch.int64),
            step=tensor([len(r.output_token_ids) & _MASK_32 for r in rows], torch.int64),
            logit_bias=_logit_bias(params, device),
            banned=_min_tokens_bans(rows, eos_token_ids, device),
            penalties=_penalties(rows, vocab_size, device),
            num_logprobs=num_logprobs,
            logprob_rows=tensor(logprob_rows, torch.int64) if logprob_rows else None,
            max_num_logprobs=max((n for n in num_logprobs if n is not None), default=0),
        )


def check_token_ids_in_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in logit_bias and stop_token_ids must exist; call at admission to answer 400."""
    for token in params.logit_bias:
        if token >= vocab_size:
            raise SamplingParamsError("logit_bias", f"logit_bias token id {token} is outside the vocabulary "
                                                    f"(0..{vocab_size - 1})")
    for token in params.stop_token_ids:
        if token >= vocab_size:
            raise SamplingParamsError("stop_token_ids", f"stop token id {token} is outside the vocabulary "
                                                        f"(0..{vocab_size - 1})")


def _logit_bias(params: list[SamplingParams], device: torch.device) -> SparseLogitUpdate | None:
    entries = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias.items()]
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    return SparseLogitUpdate(torch.tensor(rows, dtype=torch.int64, device=device),
                             torch.tensor(tokens, dtype=torch.int64, device=device),
                             torch.tensor(values, dtype=torch.float32, device=device))


def _min_tokens_bans(rows: list[ScheduledRequest], eos_token_ids: tuple[int, ...],
                     device: torch.device) -> SparseLogitUpdate | None:
    """While a row has fewer than min_tokens outputs, its stop tokens cannot be drawn. EOS is
    (every EOS id) banned too unless ignore_eos (then EOS does not stop the request, so it need not be held back)."""
    entries: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        p = r.sampling_params
        if len(r.output_token_ids) >= p.min_tokens:
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


def _penalties(rows: list[ScheduledRequest], vocab_size: int, device: torch.device) -> Penalties | None:
    params = [r.sampling_params for r in rows]
    if all(p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1 for p in params):
        return None
    out_rows = [i for i, r in enumerate(rows) for _ in r.output_token_ids]
    out_tokens = [t for r in rows for t in r.output_token_ids]
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    if out_tokens:
        counts.index_put_((torch.tensor(out_rows, device=device), torch.tensor(out_tokens, device=device)),
                          torch.ones(len(out_tokens), device=device), accumulate=True)
    seen = counts > 0
    prompt_rows = [i for i, r in enumerate(rows) if r.sampling_params.repetition_penalty != 1
                   for _ in r.prompt_token_ids]
    if prompt_rows:  # the prompt matters only for the repetition penalty
        prompt_tokens = [t for r in rows if r.sampling_params.repetition_penalty != 1 for t in r.prompt_token_ids]
        seen[torch.tensor(prompt_rows, device=device), torch.tensor(prompt_tokens, device=device)] = True

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return Penalties(counts, seen, column([p.presence_penalty for p in params]),
                     column([p.frequency_penalty for p in params]), column([p.repetition_penalty for p in params]))
