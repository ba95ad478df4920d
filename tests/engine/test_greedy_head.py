"""Greedy sampling straight from the lm_head (PackedLinear.greedy_tokens, the runner's
_greedy_without_logits): a plain greedy step of a packed bf16 model never computes its logits and
samples exactly what the logits' argmax samples; a step with any row that draws, wants logprobs or
changes a logit goes through the logits and the sampler; heads that cannot (a bias, a soft cap) say so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.engine.model.packed_linear import PackedLinear
from kvserve.kernels.cpu_bf16_gemm import bf16_gemm_available
from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.test_fused_decode import PLAN, _model, _runner, _seqs
from tests.engine.test_model_runner import run_steps

pytestmark = pytest.mark.skipif(not bf16_gemm_available(), reason="needs kvserve's bf16 kernel (AVX-512, a C++ compiler)")


def _count_calls(monkeypatch: pytest.MonkeyPatch, runner, name: str) -> list[int]:
    """Rows of every call of runner.model.<name>."""
    calls: list[int] = []
    original = getattr(runner.model, name)

    def counted(hidden: torch.Tensor):
        calls.append(hidden.shape[0])
        return original(hidden)

    monkeypatch.setattr(runner.model, name, counted)
    return calls


def test_plain_greedy_steps_sample_the_logits_argmax_without_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    direct, through_logits = _runner(_model()), _runner(_model())
    assert isinstance(direct.model.lm_head, PackedLinear)
    monkeypatch.setattr(through_logits, "_greedy_without_logits", lambda rows, batch: None)
    logits_calls = _count_calls(monkeypatch, direct, "compute_logits")
    head_calls = _count_calls(monkeypatch, direct, "greedy_tokens")
    with torch.inference_mode():
        expected = run_steps(through_logits, PLAN, _seqs())
        got = run_steps(direct, PLAN, _seqs())
    assert got == expected
    assert logits_calls == []
    # Rows that sample per step (the prompt chunks before sample nothing): the few-row vector
    # route (1, 2 rows) and the AMX blocks (21) both.
    assert head_calls == [21, 21, 21, 21, 21, 1, 2]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.0, logprobs=2),
                                    SamplingParams(temperature=0.0, logit_bias={5: 3.0})])
def test_a_step_with_any_other_row_goes_through_the_logits(monkeypatch: pytest.MonkeyPatch, params) -> None:
    runner = _runner(_model())
    seqs = _seqs()
    seqs[3] = dataclasses.replace(seqs[3], params=params)
    logits_calls = _count_calls(monkeypatch, runner, "compute_logits")
    head_calls = _count_calls(monkeypatch, runner, "greedy_tokens")
    with torch.inference_mode():
        run_steps(runner, PLAN, seqs)
    # Request r3 samples in every step with rows to sample but the last (0 and 7 only).
    assert logits_calls == [21, 21, 21, 21, 21, 1]
    assert head_calls == [2]


def test_heads_that_cannot_give_the_argmax_alone_say_so() -> None:
    model = _model()
    hidden = torch.randn(8, model.config.hidden_size).to(torch.bfloat16)
    head: PackedLinear = model.lm_head
    assert torch.equal(model.greedy_tokens(hidden), model.compute_logits(hidden).argmax(dim=-1))
    model.final_logit_soft_cap = 30.0
    assert model.greedy_tokens(hidden) is None
    model.final_logit_soft_cap = None
    head.bias = torch.zeros(head.out_features, dtype=torch.bfloat16)
    assert head.greedy_tokens(hidden) is None
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size).to(torch.bfloat16)
    assert model.greedy_tokens(hidden) is None
