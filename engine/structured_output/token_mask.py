"""The allowed tokens of the constrained rows of one step, and masking logits with them.

xgrammar fills a packed bitmask (int32 words, bit j of word w = token 32w + j). Masking adds 0
(allowed) or -inf (forbidden) to each logit of the constrained rows, in place; the other rows are
never read or written, so a batch with a few constrained rows stays as cheap as one without.

Why an addition: on CPU a boolean-masked write (masked_fill_, torch.where, xgrammar's own CPU
kernel) costs ~0.1-0.2 ms per 49k-token row, while building the additive row from a 256-entry
table (one lookup per byte of the bitmask gives 8 tokens' values) and one vectorised add cost a
fraction of that: at 8 constrained rows of 64, ~8.5 ms per step fell to ~0.2 ms (noisy machine).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

# The bitmask's int32 words are read as bytes: on a little-endian machine byte b of word w holds
# bits 8b..8b+7 of it, i.e. tokens 32w + 8b + k for bit k, so the bytes in memory order cover the
# vocabulary in order.
assert sys.byteorder == "little", "the token bitmask is read as little-endian bytes"

# Row v: the additive mask of the 8 tokens described by byte value v (bit k set = token k allowed).
_BYTE_TO_ADDITIVE = torch.where((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 1, 0.0, float("-inf"))


@dataclass(frozen=True)
class TokenMask:
    rows: Tensor  # [R] int64: indices into the step's sampling rows (logits rows), distinct
    bitmask: Tensor  # [R, ceil(vocab / 32)] int32, as xgrammar fills it


def additive_mask(bitmask: Tensor, vocab_size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[R, vocab_size] of 0 where the bitmask allows the token and -inf where it forbids it."""
    table = _BYTE_TO_ADDITIVE.to(device=device, dtype=dtype)
    # Moved as bytes (a quarter of the int64 indices' size), widened where the lookup runs.
    byte_values = bitmask.contiguous().view(torch.uint8).to(device).long()
    return torch.nn.functional.embedding(byte_values, table).flatten(1)[:, :vocab_size]


def apply_token_mask(logits: Tensor, mask: TokenMask) -> Tensor:
    """Puts every token the grammar forbids at -inf on the constrained rows of `logits`, in place
    (the step's logits are its own fresh tensor), and returns it. The other rows are untouched.
    A forbidden token whose logit is NaN stays NaN (NaN + -inf); a grammar then refuses that token
    when it is accepted, which the manager handles (manager.accept)."""
    vocab = logits.shape[-1]
    if mask.bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"a bitmask of {mask.bitmask.shape[-1]} words cannot cover {vocab} tokens")
    additive = additive_mask(mask.bitmask, vocab, logits.dtype, logits.device)
    logits.index_add_(0, mask.rows.to(logits.device), additive)
    return logits
