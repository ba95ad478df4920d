"""The grammar engine inside the engine (issue 13): the token mask touches only constrained rows,
matchers follow the sampled tokens, and with the default model several JSON schemas (nested
objects, enums, arrays with bounds, bounded strings) give outputs that parse and validate."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.engine import LLM, GrammarKind, SamplingParams, StructuredOutputParams
from kvserve.engine.structured_output import TokenMask, apply_token_mask
from kvserve.engine.structured_output.grammar_compiler import choice_grammar


def test_token_mask_forbids_only_on_constrained_rows():
    logits = torch.randn(3, 70)
    allowed = torch.zeros(1, 70, dtype=torch.bool)
    allowed[0, [0, 33, 69]] = True
    words = torch.zeros(1, 3, dtype=torch.int64)
    for token in (0, 33, 69):
        words[0, token // 32] |= 1 << (token % 32)
    bitmask = words.to(torch.int32)  # bit 31 set wraps negative, as xgrammar's int32 words do
    masked = apply_token_mask(logits, TokenMask(torch.tensor([1]), bitmask))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.isinf(masked[1][~allowed[0]]).all()
    assert torch.equal(masked[1][allowed[0]], logits[1][allowed[0]])


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
