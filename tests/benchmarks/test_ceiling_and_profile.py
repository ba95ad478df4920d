"""The arithmetic behind ceiling.py's ceiling and step_profile.py's breakdown."""

from __future__ import annotations

import pytest
from ceiling import ceiling_tokens_per_s
from model_shapes import LAYER_SHAPES, LM_HEAD
from step_profile import CATEGORIES, breakdown


def test_ceiling_counts_every_token_through_the_layers_and_output_tokens_through_lm_head() -> None:
    timings = {s.name: 0.001 for s in LAYER_SHAPES} | {LM_HEAD.name: 0.004}
    # At 2 rows a token costs 4 shapes x 30 layers x 1 ms / 2 = 60 ms in the layers, lm_head 2 ms.
    tps = ceiling_tokens_per_s(timings, rows=2, input_tokens=10, output_tokens=5)
    assert tps == pytest.approx(5 / (15 * 0.060 + 5 * 0.002))


def test_breakdown_is_exclusive_and_sums_to_the_step() -> None:
    seconds = {"step": 1.0, "forward": 0.6, "linear": 0.5, "lm_head": 0.1, "attention": 0.15, "input prep": 0.05,
               "sampler": 0.05, "scheduler+alloc": 0.02, "detokenize/output": 0.03}
    out = breakdown(seconds, steps=2)
    assert out["linear layers"] == pytest.approx(250.0)  # ms per step, lm_head included
    assert out["other model ops"] == pytest.approx((0.6 - 0.4 - 0.15) * 500)
    assert sum(out[c] for c in CATEGORIES) == pytest.approx(out["step total"]) == pytest.approx(500.0)
