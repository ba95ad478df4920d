"""The real model with --quantization int8 / int4 through the whole engine: greedy text stays
close to bf16's (floors measured with benchmarks/quant_accuracy.py, set with a margin)."""

from __future__ import annotations

import pytest

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.quantization import Int4Linear, Int8Linear

PROMPTS = ["The capital of France is", "def quicksort(items):", "Once upon a time, in a small village,",
           "Q: Why is the sky blue?\nA:", "The three laws of thermodynamics are", "My favourite book is"]
MAX_TOKENS = 24
# Share of the bf16 tokens reproduced before the first divergence, over PROMPTS.
AGREEMENT_FLOOR = {"int8": 0.3, "int4": 0.3}


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def bf16_tokens() -> list[list[int]]:
    return _greedy(LLM(dtype="bfloat16", num_kv_blocks=128, max_model_len=512))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_greedy_text_agrees_with_bf16(mode, bf16_tokens) -> None:
    llm = LLM(dtype="bfloat16", quantization=mode, num_kv_blocks=128, max_model_len=512)
    layer = llm.engine.executor.driver.runner.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Int8Linear if mode == "int8" else Int4Linear)
    tokens = _greedy(llm)
    agreeing = sum(next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
                   for ref, got in zip(bf16_tokens, tokens))
    assert agreeing / (len(PROMPTS) * MAX_TOKENS) >= AGREEMENT_FLOOR[mode]
    # Not degenerate: the first prompt still names Paris, and no continuation repeats one token.
    text = llm.get_tokenizer().decode(tokens[0])
    assert "Paris" in text
    assert all(len(set(t)) > 3 for t in tokens)
