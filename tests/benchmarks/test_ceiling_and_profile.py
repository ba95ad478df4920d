"""The arithmetic behind ceiling.py's ceiling and step_profile.py's breakdown."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from ceiling import ceiling_tokens_per_s
from model_shapes import LAYER_SHAPES, LM_HEAD
from step_profile import CATEGORIES, breakdown, profiled_op_seconds


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


@dataclass
class _Span:
    us: float

    def elapsed_us(self) -> float:
        return self.us


@dataclass
class _Event:  # the fields of a torch.profiler FunctionEvent that the profile reads
    name: str
    us: float
    cpu_parent: _Event | None = None

    @property
    def time_range(self) -> _Span:
        return _Span(self.us)


def test_profiled_ops_count_the_outermost_op_of_each_category_once() -> None:
    graph = _Event("## Call CompiledFxGraph", 900.0)
    packed = _Event("kvserve_linear::packed_linear", 100.0, graph)
    inner = _Event("mkldnn::_linear_pointwise", 90.0, packed)
    attention = _Event("kvserve::torch_paged_attention", 300.0, graph)
    attention_matmul = _Event("aten::matmul", 50.0, attention)  # part of attention, not a linear layer
    deep_mm = _Event("aten::mm", 40.0, _Event("aten::empty", 1.0, attention_matmul))
    head = _Event("aten::linear", 30.0)
    head_mm = _Event("aten::addmm", 29.0, head)
    events = [graph, packed, inner, attention, attention_matmul, deep_mm, head, head_mm,
              _Event("kvserve_cpu::write_kv_cache", 20.0, graph)]
    seconds = profiled_op_seconds(events)
    assert seconds["linear"] == pytest.approx(130e-6)
    assert seconds["attention"] == pytest.approx(320e-6)


def test_the_greedy_heads_fused_argmax_counts_as_a_linear_layer() -> None:
    # The runner's plain-greedy path calls the lm_head's matmul+argmax op outside the forward.
    seconds = profiled_op_seconds([_Event("kvserve_bf16::bf16_linear_argmax", 70.0),
                                   _Event("kvserve_bf16::bf16_linear", 30.0, _Event("kvserve_bf16::decoder_layers", 80.0))])
    assert seconds["linear"] == pytest.approx(100e-6)
