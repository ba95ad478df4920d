"""prefill_step.py sorts both engines' profiler op names into the same categories."""

from __future__ import annotations

import pytest
from prefill_step import categorize, category, main, random_prompts


@pytest.mark.parametrize("op, expected", [
    # kvserve's op names
    ("kvserve_linear::packed_linear", "linear layers"),
    ("mkldnn::_linear_pointwise", "linear layers"),
    ("kvserve_bf16::bf16_linear", "linear layers"),
    ("kvserve_cpu::paged_attention", "attention"),
    ("kvserve_cpu::write_kv_cache", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("## Call CompiledFxGraph fo4wzulp56rs3ykkecrfpba4h4yc ##", "fused elementwise"),
    # vLLM's
    ("_C::onednn_mm", "linear layers"),
    ("_C::weight_packed_linear", "linear layers"),
    ("_C::cpu_attention_with_kv_cache", "attention"),
    ("_C::cpu_attn_reshape_and_cache", "attention"),
    ("vllm::unified_attention_with_output", "attention"),
    ("## Call CompiledFxGraph None ##", "fused elementwise"),
    # both
    ("aten::addmm", "linear layers"),
    ("aten::copy_", "everything else"),
    ("aten::empty", "everything else"),
])
def test_op_names_of_both_engines_fall_in_the_same_categories(op: str, expected: str) -> None:
    assert category(op) == expected


def test_prompts_are_seeded_and_of_the_asked_shape() -> None:
    prompts = random_prompts(3, count=4, length=7)
    assert [len(p) for p in prompts] == [7, 7, 7, 7]
    assert prompts == random_prompts(3, count=4, length=7) != random_prompts(4, count=4, length=7)


def test_a_burst_larger_than_one_step_is_refused_before_any_engine_loads(monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["prefill_step.py", "--engine", "kvserve", "--num-prompts", "32",
                                     "--prompt-len", "128"])
    with pytest.raises(SystemExit, match="do not fit one step of 2048"):
        main()


class _Span:
    def __init__(self, us: float) -> None:
        self.us = us

    def elapsed_us(self) -> float:
        return self.us


class _Event:  # the fields of a torch.profiler FunctionEvent that categorize() reads
    def __init__(self, name: str, total_us: float, self_us: float, parent: "_Event | None" = None) -> None:
        self.name, self.time_range, self.self_cpu_time_total, self.cpu_parent = name, _Span(total_us), self_us, parent


def test_ops_count_whole_once_and_a_graph_only_its_own_time() -> None:
    graph = _Event("## Call CompiledFxGraph abc ##", total_us=10_000, self_us=3_000)
    attention = _Event("kvserve_cpu::paged_attention", total_us=4_000, self_us=500, parent=graph)
    sdpa = _Event("aten::_scaled_dot_product_flash_attention_for_cpu", total_us=3_000, self_us=2_500, parent=attention)
    gather = _Event("aten::copy_", total_us=500, self_us=500, parent=sdpa)
    linear = _Event("mkldnn::_linear_pointwise", total_us=2_500, self_us=2_000, parent=graph)
    reorder = _Event("aten::copy_", total_us=500, self_us=500, parent=linear)
    loose = _Event("aten::copy_", total_us=700, self_us=700)
    out = categorize([graph, attention, sdpa, gather, linear, reorder, loose])
    assert out == {"fused elementwise": 3.0, "attention": 4.0, "linear layers": 2.5}
