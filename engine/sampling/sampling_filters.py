"""min-p, top-k and top-p truncation of temperature-scaled logits, per row, for a whole batch.

Order and definitions (vLLM's): min-p drops tokens with p < min_p * p_max; top-k keeps the k
most likely of the rest; top-p keeps the smallest most-likely set whose probability,
renormalised over what min-p and top-k left, reaches top_p. The most likely token always stays.

Sorting a 49k vocabulary for 64 rows costs ~220 ms on a CPU core, while the best 256 tokens cost
~11 ms and almost always contain everything the filters keep. So the filters run on the best
`candidates` tokens of each row and only rows whose kept set might reach past them run again with
more candidates (finally the whole sorted row). A row's answer is the same in every pass: the
prefix sums over its best tokens do not depend on how many candidates were taken.

        candidates (descending):  v0  v1  v2 ... v(K-1) | rest of the row (unseen)
        min-p cut:                value < v0 + log(min_p)
        top-k cut:                position >= k
        top-p cut:                mass of the better tokens >= top_p
        settled when the unseen rest is surely cut: k <= K, or v(K-1) below the min-p line, or
        the candidates' mass already reaches top_p.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Candidate counts per pass; the last pass takes the whole (sorted) row.
_CANDIDATE_PASSES = (256, 4096)
_NEG_INF = float("-inf")


def filter_logits(logits: Tensor, top_k: Tensor | None = None, top_p: Tensor | None = None,
                  min_p: Tensor | None = None) -> Tensor:
    """`logits` with every filtered-out token set to -inf; per-row parameters of shape [B]:
    top_k (0 = off), top_p (1.0 = off), min_p (0.0 = off). None: no row uses that filter."""
    if top_k is None and top_p is None and min_p is None:
        return logits
    rows, vocab = logits.shape
    device = logits.device
    k = torch.full((rows,), vocab, device=device) if top_k is None else torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    p = torch.ones(rows, device=device) if top_p is None else top_p
    log_min_p = torch.full((rows,), _NEG_INF, device=device) if min_p is None else torch.log(min_p)
    line = logits.max(dim=-1, keepdim=True).values + log_min_p.unsqueeze(1)  # the min-p line

    def above_line(rows_logits: Tensor, rows_line: Tensor) -> Tensor:
        return rows_logits if min_p is None else rows_logits.masked_fill(rows_logits < rows_line, _NEG_INF)

    # top-p's normaliser when the kept set may reach past the candidates: everything above the line.
    whole_log_total = None if top_p is None else above_line(logits, line).logsumexp(dim=-1, keepdim=True)

    max_k = int(k.masked_fill(k >= vocab, 0).max())
    pending = torch.arange(rows, device=device)
    whole_rows = []
    out: Tensor | None = None
    for candidates in (*_CANDIDATE_PASSES, vocab):
        candidates = min(max(candidates, max_k), vocab)
        everyone = out is None  # first pass: every row, no gathers
        part = logits if everyone else logits.index_select(0, pending)
        filtered, order, settled, whole = _filter_candidates(
            part, k[pending], p[pending], line[pending],
            None if whole_log_total is None else whole_log_total[pending], candidates)
        if everyone and bool(settled.all()):
            return torch.full_like(logits, _NEG_INF).scatter_(1, order, filtered)
        if out is None:
            out = torch.full_like(logits, _NEG_INF)
        done = settled.nonzero().squeeze(1)
        if done.numel():
            scattered = torch.full((done.numel(), vocab), _NEG_INF, device=device)
            out.index_copy_(0, pending[done], scattered.scatter_(1, order[done], filtered[done]))
        whole_rows.append(pending[whole])
        pending = pending[~settled & ~whole]
        if pending.numel() == 0:
            break
    assert out is not None
    # Rows with neither top-k nor top-p keep the whole row above the min-p line.
    whole = torch.cat(whole_rows)
    if whole.numel():
        out.index_copy_(0, whole, above_line(logits.index_select(0, whole), line.index_select(0, whole)))
    return out


def _filter_candidates(logits: Tensor, k: Tensor, p: Tensor, line: Tensor, whole_log_total: Tensor | None,
                       candidates: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Filtered candidate logits [R, C] (-inf where cut), their vocabulary ids [R, C], the rows
    this pass settles, and the rows that keep tokens beyond the candidates with no top-p to cut
    them (no top-k, top_p 1, min-p line below the candidates): those need the whole row."""
    vocab = logits.shape[-1]
    if candidates == vocab:
        values, order = logits.sort(dim=-1, descending=True)
    else:
        values, order = logits.topk(candidates, dim=-1)
    position = torch.arange(candidates, device=logits.device).unsqueeze(0)
    values = values.masked_fill((position >= k.unsqueeze(1)) | (values < line), _NEG_INF)
    # The rest of the row is cut by top-k or min-p: renormalise over the candidates alone.
    rest_cut = (k <= candidates) | (values[:, -1] == _NEG_INF) | (candidates == vocab)
    nucleus = p < 1.0
    if whole_log_total is None:  # no row uses top-p
        return values, order, rest_cut, ~rest_cut
    log_total = torch.where(rest_cut.unsqueeze(1), values.logsumexp(dim=-1, keepdim=True), whole_log_total)
    probs = (values - log_total).exp()
    mass = probs.cumsum(dim=-1)
    keep = ((mass - probs) < p.unsqueeze(1)) | ~nucleus.unsqueeze(1) | (position == 0)
    filtered = values.masked_fill(~keep, _NEG_INF)
    settled = rest_cut | (nucleus & (mass[:, -1] >= p))
    return filtered, order, settled, ~rest_cut & ~nucleus
