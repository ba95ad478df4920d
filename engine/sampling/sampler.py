"""Choosing the next token of every sampling row at once.

    raw logits ─► logit_bias, min_tokens bans ─► penalties ─┬─► argmax                 (greedy rows)
                                                            └─► / temperature ─► min_p ─► top_k ─► top_p
                                                                ─► inverse-CDF draw with u(seed, step)  (other rows)
    raw logits ─► log_softmax ─► chosen token's logprob, rank, top-N                (rows asking for logprobs)

The order follows vLLM: logits processors, then penalties, then temperature, then the
truncation filters; top-p sees the distribution already cut by min-p and top-k. Every stage is
a tensor operation over the rows that use it, with per-row parameters: penalties touch only the
penalised rows, temperature and the filters only the rows that draw, logprobs only the rows that
ask; a greedy row costs one argmax. The truncation filters live in sampling_filters.py, the
counter-based random numbers in sampling_noise.py, the penalties' token counts in token_counts.py.

Drawing: one uniform number u per row, a pure function of (seed, number of output tokens so far),
picks the token whose cumulative-probability interval (in vocabulary order) contains u. So a
seeded request gives the same tokens whatever else is in the batch, and again after a preemption
recomputes it. One number per row also costs far less than one per vocabulary entry, which the
Gumbel-max trick would need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvserve.engine.sampling.sampling_batch import RandomRows, SamplingBatch
from kvserve.engine.sampling.sampling_filters import filter_logits
from kvserve.engine.sampling.sampling_noise import uniform_from_counter
from kvserve.engine.sampling.token_counts import Penalties, TokenCounts
from kvserve.kernels.cpu_bf16_gemm import bf16_gemm_available, bf16_row_argmax
from kvserve.scheduler.output import TokenLogprobs

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch"]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row: None unless the request asked for logprobs


class Sampler:
    """Holds one piece of state across steps: the penalised requests' token counts."""

    def __init__(self) -> None:
        self.token_counts = TokenCounts()

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [num_sampling_rows={batch.num_rows}, vocab], got {tuple(logits.shape)}")
        if batch.is_plain_greedy:
            # Only an argmax: no float32 copy of [rows, vocab] half-precision logits (upcasting
            # is exact, so the argmax is the same).
            return SamplerOutput(token_ids=greedy_tokens(logits).tolist(), logprobs=[None] * batch.num_rows)
        raw = logits.float()
        processed = self.processed_logits(raw, batch)
        random = batch.random
        if random is None:
            token_ids = greedy_tokens(processed)
        elif len(random.rows) == batch.num_rows:  # nobody is greedy: no row copies, no argmax
            token_ids = sample_rows(processed, random)
        else:
            drawn = sample_rows(processed.index_select(0, random.rows), random)
            token_ids = greedy_tokens(processed).index_copy_(0, random.rows, drawn)
        logprobs = compute_logprobs(raw, token_ids, batch)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def processed_logits(self, raw: Tensor, batch: SamplingBatch) -> Tensor:
        """logit_bias, min_tokens bans and penalties applied (a new tensor when any applies);
        what the argmax and the temperature see."""
        processed = apply_logits_processors(raw, batch)
        if batch.penalties is None:
            return processed
        rows = batch.penalties.rows
        penalties = self.token_counts.penalties(batch.penalties, batch.vocab_size)
        return processed.index_copy(0, rows, apply_penalties(processed.index_select(0, rows), penalties))


# Chunk widths of greedy_tokens' first pass, widest first: the widest that divides the vocabulary
# is used. Measured (64 rows x 49152 bf16 logits, 2 threads): 512 wide 636 us, 256 681, 128 833,
# 1024 699 (the second pass's argmax over the chosen chunk grows); 16 rows: 162, 175, 211, 187.
_ARGMAX_CHUNKS = (512, 256, 128)


def greedy_tokens(logits: Tensor) -> Tensor:
    """Each row's argmax: the first maximum, a NaN counting as the maximum (argmax's rules).

    On CPU, torch's argmax (and max with indices) over [rows, 49152] float32 logits runs at a
    fraction of memory speed, and more slowly still once the logits outgrow the cache: at 64
    rows it cost more than everything else a greedy step samples. bf16 logits (a bf16 model's)
    go to kvserve's C++ argmax where it is built (kernels/cpu_bf16_gemm.py: one pass, 4x the
    path below). Otherwise the CPU path finds each row's first best chunk of up to 512 tokens
    with amax (a plain vectorised reduction), then the first best token inside that one chunk.
    Ties and NaNs resolve as in argmax: amax keeps NaN, and both passes take the first index of
    their maximum."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    if logits.dtype is torch.bfloat16 and vocab > 0 and bf16_gemm_available():
        return bf16_row_argmax(logits)  # a half-precision lm_head's logits: one pass in C++
    chunk = next((width for width in _ARGMAX_CHUNKS if vocab % width == 0), None)
    if chunk is None:
        return logits.argmax(dim=-1)
    chunks = logits.view(rows, vocab // chunk, chunk)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)
    inside = chunks[torch.arange(rows, device=logits.device), best_chunk].argmax(dim=-1)
    return best_chunk * chunk + inside


def apply_logits_processors(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """logit_bias (added) and min_tokens bans (-inf). Returns a new tensor; `logits` is untouched."""
    if batch.logit_bias is None and batch.banned is None:
        return logits
    logits = logits.clone()
    if batch.logit_bias is not None:
        bias = batch.logit_bias
        logits.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)
    if batch.banned is not None:
        logits.index_put_((batch.banned.rows, batch.banned.tokens), batch.banned.values)
    return logits


def apply_penalties(logits: Tensor, penalties: Penalties) -> Tensor:
    """Repetition (HF/vLLM): a seen token's positive logit is divided by the penalty, a negative
    one multiplied. Presence/frequency (OpenAI): logit -= presence * [count > 0] + frequency * count.
    `logits` holds the penalised rows only, in the order of `penalties`."""
    repetition = torch.where(logits > 0, logits / penalties.repetition, logits * penalties.repetition)
    logits = torch.where(penalties.seen, repetition, logits)
    counts = penalties.output_counts
    return logits - penalties.frequency * counts - penalties.presence * (counts > 0).to(logits.dtype)


def sample_rows(logits: Tensor, random: RandomRows) -> Tensor:
    """Draw one token per row of `logits` (the random rows, in order) after temperature and filters."""
    logits = logits / random.temperature.unsqueeze(1)
    logits = filter_logits(logits, top_k=random.top_k, top_p=random.top_p, min_p=random.min_p)
    return draw_inverse_cdf(logits, uniform_from_counter(random.seed_lo, random.seed_hi, random.step))


# Tokens per chunk in the two-level draw below.
_DRAW_CHUNK = 128


def draw_inverse_cdf(logits: Tensor, u: Tensor) -> Tensor:
    """The token whose interval of the cumulative distribution, in vocabulary order, contains u.

    Two levels, so a 50k-entry tail is not lost to float32 rounding in one long running sum and no
    float64 copy of the whole row is made: pick the chunk of `_DRAW_CHUNK` tokens from the chunk
    totals, then the token inside it. Masked tokens (weight 0) are never picked.
    """
    rows, vocab = logits.shape
    weights = (logits - logits.max(dim=-1, keepdim=True).values).exp_()
    padded = -vocab % _DRAW_CHUNK
    if padded:
        weights = torch.nn.functional.pad(weights, (0, padded))
    chunks = weights.view(rows, -1, _DRAW_CHUNK)
    # Chunk totals in float32 (128 terms: relative error ~1e-7), accumulated in float64.
    chunk_cdf = chunks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)
    target = u * chunk_cdf[:, -1]
    chunk = torch.searchsorted(chunk_cdf, target.unsqueeze(1), right=True).clamp_(max=chunk_cdf.shape[1] - 1)
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), torch.zeros_like(target).unsqueeze(1))
    inside = chunks.gather(1, chunk.unsqueeze(2).expand(-1, -1, _DRAW_CHUNK)).squeeze(1).to(torch.float64)
    offset = torch.searchsorted(inside.cumsum(dim=-1), target.unsqueeze(1) - before, right=True)
    # Rounding between a chunk's total and its in-chunk sum may step past its last real token.
    positions = torch.arange(_DRAW_CHUNK, device=logits.device)
    last_positive = torch.where(inside > 0, positions, 0).max(dim=-1, keepdim=True).values
    token = chunk * _DRAW_CHUNK + torch.minimum(offset, last_positive)
    return token.squeeze(1)


def compute_logprobs(raw_logits: Tensor, token_ids: Tensor, batch: SamplingBatch) -> list[TokenLogprobs | None]:
    """Logprobs of the raw model distribution (before penalties, temperature and filters), as the
    OpenAI API reports them: the chosen token's, its rank (1 = most likely) and the top-N."""
    result: list[TokenLogprobs | None] = [None] * batch.num_rows
    if batch.logprob_rows is None:
        return result
    rows = batch.logprob_rows
    logprobs = torch.log_softmax(raw_logits.index_select(0, rows), dim=-1)
    chosen_ids = token_ids.index_select(0, rows)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1) if batch.max_num_logprobs else (None, None)
    # One transfer per tensor; the loop below only builds the output records.
    chosen_list = chosen.squeeze(1).tolist()
    rank_list = ranks.tolist()
    chosen_id_list = chosen_ids.tolist()
    top_value_list = top_values.tolist() if top_values is not None else None
    top_id_list = top_ids.tolist() if top_ids is not None else None
    for j, row in enumerate(rows.tolist()):
        n = batch.num_logprobs[row] or 0
        top = list(zip(top_id_list[j][:n], top_value_list[j][:n])) if n and top_id_list and top_value_list else []
        result[row] = TokenLogprobs(token_id=chosen_id_list[j], logprob=chosen_list[j], rank=rank_list[j], top=top)
    return result
