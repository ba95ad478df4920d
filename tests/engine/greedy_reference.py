"""Greedy continuations from transformers, and a comparison that tolerates only near-ties.

Batched float32 math can differ from transformers' in the last bits, so two runs may part ways
where transformers' top two logits are within NEAR_TIE of each other. Such a divergence is
reported (returned), never hidden; any other divergence is a failure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-3


@dataclass(frozen=True)
class GreedyReference:
    token_ids: list[int]
    top2_gaps: list[float]  # transformers' top-1 minus top-2 logit at each generated position


def transformers_greedy(model, prompt_token_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> GreedyReference:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_token_ids]),
            attention_mask=torch.ones(1, len(prompt_token_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )
    tokens = out.sequences[0, len(prompt_token_ids):].tolist()
    gaps = []
    for scores in out.scores:
        top2 = scores[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return GreedyReference(tokens, gaps)


def divergence(ours: list[int], reference: GreedyReference) -> str | None:
    """None when `ours` equals the reference. A near-tie divergence returns a description (the
    caller reports it); any other mismatch raises AssertionError."""
    ref = reference.token_ids
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = reference.top2_gaps[i]
            assert gap < NEAR_TIE, (
                f"greedy output diverges at generated token {i}: ours {a}, transformers {b}; "
                f"transformers' top-2 logit gap there is {gap:.2e} (not a near-tie)\nours: {ours}\nref:  {ref}"
            )
            return f"near-tie divergence at token {i} (top-2 gap {gap:.2e}): ours {a}, transformers {b}"
    assert len(ours) == len(ref), f"length differs: ours {len(ours)}, transformers {len(ref)}\nours: {ours}\nref:  {ref}"
    return None
