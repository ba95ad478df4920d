"""kvserve's op names as torch.profiler records them, and the outermost-op count over a profile's
events, shared by step_profile.py and prefill_step.py. Standard library only: prefill_step.py
runs in vLLM's venv too."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

KVSERVE_ATTENTION_OP_PREFIXES = ("kvserve::", "kvserve_cpu::")
KVSERVE_LINEAR_OPS = frozenset({"kvserve_linear::packed_linear", "mkldnn::_linear_pointwise", "aten::linear", "aten::mm",
                                "aten::addmm", "aten::matmul", "aten::_weight_int8pack_mm",
                                "aten::_weight_int4pack_mm_for_cpu", "kvserve_bf16::bf16_linear",
                                "kvserve_bf16::bf16_linear_argmax",  # the greedy lm_head: a linear layer too
                                "kvserve_bf16::bf16_linear_silu_mul",  # gate_up with SiLU x up in its passes
                                "kvserve_quant::int4_gemm", "kvserve_quant::int8_gemm"})


def kvserve_op_category(name: str) -> str | None:
    if name.startswith(KVSERVE_ATTENTION_OP_PREFIXES):
        return "attention"
    return "linear" if name in KVSERVE_LINEAR_OPS else None


def outermost_op_seconds(events: Any, classify: Callable[[str], str | None]) -> dict[str, float]:
    """Seconds per category from torch.profiler FunctionEvents (.name, .cpu_parent, .time_range),
    counting only the outermost event of any category on each call stack: an op nested in another
    op of a category (aten::mm inside aten::linear, SDPA inside paged attention) counts once, for
    the outer."""
    seconds: dict[str, float] = defaultdict(float)
    for event in events:
        category = classify(event.name)
        if category is None:
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested = classify(parent.name) is not None
            parent = parent.cpu_parent
        if not nested:
            seconds[category] += event.time_range.elapsed_us() / 1e6
    return seconds
