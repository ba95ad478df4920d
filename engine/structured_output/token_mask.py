"""The allowed tokens of the constrained rows of one step, and masking logits with them.

xgrammar fills a packed bitmask (int32 words, bit j of word w = token 32w + j). Unpacking it to a
boolean [rows, vocab] mask and filling the disallowed logits with -inf is plain torch, so it runs
on any device and touches only the constrained rows: a batch without them pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenMask:
    rows: Tensor  # [R] int64: indices into the step's sampling rows (logits rows)
    bitmask: Tensor  # [R, ceil(vocab / 32)] int32, as xgrammar fills it


def apply_token_mask(logits: Tensor, mask: TokenMask) -> Tensor:
    """Returns `logits` with every token the grammar forbids at -inf on the constrained rows."""
    device = logits.device
    vocab = logits.shape[-1]
    words = mask.bitmask.to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    rows = mask.rows.to(device)
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
