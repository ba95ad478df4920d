"""Counter-based random numbers: one uniform per row, a pure function of (seed, step).

A stateful generator shared by the batch would hand a request different numbers depending on
who else is in the batch and in which order; a per-request `torch.Generator` would need a Python
loop per row. Hashing (seed, step) gives every row its own stream with plain tensor arithmetic,
and a preempted request that is recomputed draws the same numbers again because `step` (its
number of output tokens) is the same.

The mixer is a 32-bit xorshift-multiply finalizer (Wellons' "lowbias32" constants). Values stay
below 2**32 in int64 tensors and both multipliers are below 2**31, so no product overflows int64
on any backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK_32 = 0xFFFFFFFF
# Distinct odd constants keep the seed halves, the step and the two output words apart.
_SALT_SEED_LO = 0x9E3779B9
_SALT_SEED_HI = 0x85EBCA6B
_SALT_STEP = 0xC2B2AE35
_SALT_WORD_A = 0x27D4EB2F
_SALT_WORD_B = 0x165667B1


def mix32(x: Tensor) -> Tensor:
    """A bijection on [0, 2**32) with good avalanche; `x` is int64 holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK_32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK_32
    return x ^ (x >> 15)


def uniform_from_counter(seed_lo: Tensor, seed_hi: Tensor, step: Tensor) -> Tensor:
    """float64 uniforms in the open interval (0, 1) with 53 random bits, one per element."""
    h = mix32(seed_lo ^ _SALT_SEED_LO)
    h = mix32(h ^ seed_hi ^ _SALT_SEED_HI)
    h = mix32(h ^ step ^ _SALT_STEP)
    high = mix32(h ^ _SALT_WORD_A)  # 32 bits
    low = mix32(h ^ _SALT_WORD_B) >> 11  # 21 bits
    bits = (high << 21) | low  # 53 bits: exactly representable in float64
    return (bits.to(torch.float64) + 0.5) / float(1 << 53)
