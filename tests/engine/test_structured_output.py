"""The grammar engine inside the engine (issue 13): the token mask touches only constrained rows,
matchers follow the sampled tokens, and with the default model several JSON schemas (nested
objects, enums, arrays with bounds, bounded strings) give outputs that parse and validate."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.engine import LLM, GrammarKind, SamplingParams, StructuredOutputParams
from kvserve.engine.structured_output import TokenMask, apply_token_mask
from kvserve.engine.structured_output.xgrammar_grammars import choice_grammar


def test_token_mask_forbids_only_on_constrained_rows():
    logits = torch.randn(3, 70)
    original = logits.clone()
    allowed = torch.zeros(1, 70, dtype=torch.bool)
    allowed[0, [0, 33, 69]] = True
    words = torch.zeros(1, 3, dtype=torch.int64)
    for token in (0, 33, 69):
        words[0, token // 32] |= 1 << (token % 32)
    bitmask = words.to(torch.int32)  # bit 31 set wraps negative, as xgrammar's int32 words do
    masked = apply_token_mask(logits, TokenMask(torch.tensor([1]), bitmask))
    assert masked is logits  # in place: the step's logits are its own
    assert torch.equal(masked[[0, 2]], original[[0, 2]])
    assert torch.all(masked[1][~allowed[0]] == float("-inf"))
    assert torch.equal(masked[1][allowed[0]], original[1][allowed[0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_mask_matches_xgrammar_on_scattered_rows(dtype):
    """Every bit of every word (bit 31 included) lands on its token, for rows anywhere in the
    batch and a vocabulary that ends inside a word; same as xgrammar's reference kernel."""
    import xgrammar as xgr

    vocab, rows = 100, torch.tensor([4, 0, 2])
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=generator)
    logits = torch.randn(6, vocab, generator=generator).to(dtype)
    expected = logits.clone()
    full = torch.full((6, 4), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, indices=rows.tolist(), vocab_size=vocab)
    assert torch.equal(apply_token_mask(logits, TokenMask(rows, bitmask)), expected)


def test_token_mask_rejects_a_bitmask_shorter_than_the_vocabulary():
    with pytest.raises(ValueError, match="cannot cover"):
        apply_token_mask(torch.zeros(1, 70), TokenMask(torch.tensor([0]), torch.zeros(1, 2, dtype=torch.int32)))


def test_choice_grammar_escapes_quotes():
    assert choice_grammar(['a "b"', "c\\d"]) == 'root ::= "a \\"b\\"" | "c\\\\d"'
    with pytest.raises(ValueError):
        choice_grammar([])


SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15}},
                    "required": ["city"], "additionalProperties": False}},
     "required": ["name", "age", "tags", "address"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {
        "x": {"type": "number"}, "ok": {"type": "boolean"}}, "required": ["x", "ok"], "additionalProperties": False},
     "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]},
                                      "priority": {"type": "integer", "enum": [1, 2, 3]}},
     "required": ["status", "priority"], "additionalProperties": False},
]


@pytest.mark.slow
def test_default_model_json_schema_outputs_validate():
    import jsonschema

    llm = LLM(dtype="float32")
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Answer in JSON."}])
    params = [SamplingParams(temperature=t, seed=7, max_tokens=150,
                             structured_output=StructuredOutputParams(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
              for schema in SCHEMAS for t in (0.0, 0.8)]
    free = SamplingParams(temperature=0.0, max_tokens=20)
    outputs = llm.generate([prompt] * (len(params) + 1), [*params, free], use_tqdm=False)
    for output, p in zip(outputs, params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), json.loads(p.structured_output.spec))
    # The unconstrained row in the same batches is what it is alone.
    assert outputs[-1].outputs[0].text == llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].text


def test_a_completed_grammar_frees_the_row_under_ignore_eos(tmp_path):
    """Once the grammar has taken its stop token, an ignore_eos row goes on unconstrained (xgrammar
    has no mask for a terminated matcher; asking it for one raises), and its batch neighbours are
    what they are alone."""
    from tests.engine.tiny_model_dir import TOKENIZER_EOS, write_tiny_model

    llm = LLM(str(write_tiny_model(tmp_path / "m")), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    choice = StructuredOutputParams(GrammarKind.CHOICE, json.dumps(["w7"]))
    bound = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, structured_output=choice)
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["w5 w6", "w9 w10 w11"]
    outputs = llm.generate(prompts, [bound, free], use_tqdm=False)
    constrained = outputs[0].outputs[0].token_ids
    assert constrained[:2] == [7, TOKENIZER_EOS] and len(constrained) == 6
    assert outputs[1].outputs[0].token_ids == llm.generate(prompts[1], free, use_tqdm=False)[0].outputs[0].token_ids
    assert not llm.engine.structured_output._matchers  # nothing left behind
