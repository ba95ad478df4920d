"""Verifying drafts: which of a request's drafted tokens it keeps.

A request with drafts d_0 .. d_{k-1} is computed at k + 1 positions in one forward: after its
last token, and after each draft. The sampler draws a token t_i at each (greedy: the argmax; else
a draw with the uniform number of that output position). The request keeps t_0 .. t_a, where a is
the first i with t_i != d_i (or k when all drafts match):

    drafts       d0   d1   d2
    sampled      t0   t1   t2   t3
    d0 == t0, d1 != t1   ->  kept: t0, t1   (t1 corrects d1; d2, t2, t3 are discarded)

Greedy rows thus produce exactly what decoding without drafts would. For sampled rows this is
rejection sampling with the draft taken as certain (vLLM's "no draft probabilities" case): d_i
is kept with probability p_i(d_i) (the chance that t_i == d_i), and when it is not, t_i is a draw
from p_i restricted to tokens other than d_i, which is the residual distribution (p_i - q_i)+
normalised for a one-point draft q_i. Every kept token therefore has the target distribution.
And because t_i uses the random number of its output position, a seeded request draws the same
tokens with drafts as without.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_kept(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many of a request's `sampled` tokens (one per row: len(drafts) + 1) it keeps."""
    accepted = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        accepted += 1
    return accepted + 1
