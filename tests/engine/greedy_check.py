"""Comparing greedy continuations with transformers' (from conftest.transformers_greedy).

Batched float32 math may differ from transformers' in the last bits, so two runs may part ways
where transformers' top two logits are within NEAR_TIE. Such a divergence is returned as a note
(the caller warns with it and bounds how many it accepts); any other divergence fails.
"""

from __future__ import annotations

import warnings

NEAR_TIE = 1e-3


def near_tie_divergences(ours: list[list[int]], references) -> list[str]:
    notes = []
    for n, (tokens, ref) in enumerate(zip(ours, references)):
        assert len(tokens) == len(ref.token_ids), (
            f"prompt {n}: {len(tokens)} tokens, transformers {len(ref.token_ids)}")
        i = next((i for i, (a, b) in enumerate(zip(tokens, ref.token_ids)) if a != b), None)
        if i is None:
            continue
        gap = ref.top2_gaps[i]
        assert gap < NEAR_TIE, (
            f"prompt {n}: greedy output diverges at token {i} (ours {tokens[i]}, transformers "
            f"{ref.token_ids[i]}) where transformers' top-2 gap is {gap:.2e}, not a near-tie"
        )
        notes.append(f"prompt {n} token {i}: gap {gap:.2e}, ours {tokens[i]} vs {ref.token_ids[i]}")
    if notes:
        warnings.warn(f"{len(notes)} near-tie divergence(s): " + "; ".join(notes), stacklevel=2)
    return notes
