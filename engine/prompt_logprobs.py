"""Logprobs of the prompt's own tokens, computed in the same forward pass as its prefill.

The logits at position p score token p + 1, so a prefill chunk covering positions [s, e) of a
P-token prompt scores prompt tokens s + 1 .. min(e, P - 1); position P - 1 predicts the first
output token and is the sampler's business. Prompt token 0 has no logprob (nothing precedes it).

    flat batch rows:   | req A chunk (positions s..e-1) | req B (decode) | req C chunk ... |
    rows scored:         s .. min(e, P-1) - 1             -                 ...
    target of row p:     prompt_token_ids[p + 1]

Logits for many prompt rows are [rows, vocab] float32: they are computed in slices of
`_ROWS_PER_SLICE` rows so a long prompt does not need one huge allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvserve.scheduler.output import PromptLogprobs, TokenLogprobs

if TYPE_CHECKING:
    from kvserve.engine.input_batch import CachedRequestState

_ROWS_PER_SLICE = 256


@dataclass(frozen=True)
class _Span:
    request_id: str
    first_position: int  # of the first scored prompt token
    count: int
    num_top: int


@dataclass(frozen=True)
class PromptLogprobsPlan:
    """Which rows of this step's hidden states score which prompt tokens."""

    spans: list[_Span]
    rows: list[int]
    targets: list[int]

    @classmethod
    def from_scheduled(cls, scheduled: Sequence[CachedRequestState]) -> "PromptLogprobsPlan | None":
        """None when no request in the step asks for prompt logprobs (the common case costs one
        attribute read per request)."""
        spans: list[_Span] = []
        rows: list[int] = []
        targets: list[int] = []
        first_row = 0
        for request in scheduled:
            row, first_row = first_row, first_row + request.num_new_tokens
            num_top = request.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            start = request.num_computed_tokens
            end = min(start + request.num_new_tokens, request.num_prompt_tokens - 1)
            if end <= start:
                continue  # a decode step, or only the last prompt position
            spans.append(_Span(request.request_id, start + 1, end - start, num_top))
            rows.extend(range(row, row + end - start))
            targets.extend(request.all_token_ids[start + 1:end + 1])
        return cls(spans, rows, targets) if spans else None


def compute_prompt_logprobs(hidden: Tensor, plan: PromptLogprobsPlan,
                            compute_logits: Callable[[Tensor], Tensor]) -> dict[str, PromptLogprobs]:
    """`compute_logits` maps hidden rows to logits (the model's head). Logprobs are of the raw
    model distribution, in float32, as OpenAI and vLLM report them."""
    max_top = max(span.num_top for span in plan.spans)
    device = hidden.device
    rows = torch.tensor(plan.rows, dtype=torch.long, device=device)
    targets = torch.tensor(plan.targets, dtype=torch.long, device=device)
    chosen_parts, rank_parts, top_value_parts, top_id_parts = [], [], [], []
    for lo in range(0, len(plan.rows), _ROWS_PER_SLICE):
        piece = slice(lo, lo + _ROWS_PER_SLICE)
        logprobs = torch.log_softmax(compute_logits(hidden[rows[piece]]).float(), dim=-1)
        chosen = logprobs.gather(1, targets[piece].unsqueeze(1))
        chosen_parts.append(chosen.squeeze(1))
        rank_parts.append((logprobs > chosen).sum(dim=-1) + 1)
        if max_top:
            values, ids = logprobs.topk(max_top, dim=-1)
            top_value_parts.append(values)
            top_id_parts.append(ids)
    chosen_list = torch.cat(chosen_parts).tolist()
    rank_list = torch.cat(rank_parts).tolist()
    top_values = torch.cat(top_value_parts).tolist() if max_top else None
    top_ids = torch.cat(top_id_parts).tolist() if max_top else None
    result: dict[str, PromptLogprobs] = {}
    offset = 0
    for span in plan.spans:
        entries = []
        for j in range(offset, offset + span.count):
            top = list(zip(top_ids[j][:span.num_top], top_values[j][:span.num_top])) if top_ids and top_values else []
            entries.append(TokenLogprobs(token_id=plan.targets[j], logprob=chosen_list[j], rank=rank_list[j], top=top))
        result[span.request_id] = PromptLogprobs(span.first_position, entries)
        offset += span.count
    return result
