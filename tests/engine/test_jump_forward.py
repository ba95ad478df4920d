"""Jump-forward decoding: text a grammar forces is appended in the tokenizer's own tokens at once,
computed with the request's next step, instead of one forward per token."""

from __future__ import annotations

import json

import pytest

from kvserve.engine import LLM, GrammarKind, SamplingParams, StructuredOutputParams


class _Steps:
    def __init__(self) -> None:
        self.steps = self.generated = 0

    def on_step(self, stats) -> None:
        self.steps += 1
        self.generated += stats.num_generation_tokens

    def on_request_finished(self, stats) -> None:
        pass


def _tiny_llm(path, **kwargs) -> tuple[LLM, _Steps]:
    from tests.engine.tiny_model_dir import write_tiny_model

    model = path / "m"
    if not model.exists():
        write_tiny_model(model)
    llm = LLM(str(model), dtype="float32", num_kv_blocks=96, enforce_eager=True, **kwargs)
    steps = _Steps()
    llm.engine.stats_listeners.append(steps)
    return llm, steps


def test_forced_text_costs_one_step_and_the_output_is_what_sampling_it_gives(tmp_path):
    # After the model picks w8 or w9, the grammar forces "w5w6w7w5w6" (word tokens carry no
    # spaces): appended at once, computed with the next step, which samples the choice after it.
    # Single-digit words only: no other token of this vocabulary is a prefix of such text, so
    # sampling it token by token gives the same tokens (two-digit words could be spelled "w4" +
    # "0...", a dead end for this vocabulary). The tokenizer cannot split the glued words (one
    # unknown word), so xgrammar's own split is used.
    regex = StructuredOutputParams(GrammarKind.REGEX, "(w8|w9)w5w6w7w5w6(w3|w4)w7w6")
    params = [SamplingParams(temperature=0.0, max_tokens=20, structured_output=regex),
              SamplingParams(temperature=0.9, seed=5, max_tokens=20, structured_output=regex, n=2)]
    prompts = ["w5 w6 w7", "w8 w9"]
    plain, plain_steps = _tiny_llm(tmp_path, jump_forward=False)
    jumping, jump_steps = _tiny_llm(tmp_path)
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = jumping.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got):
        for w, h in zip(want.outputs, have.outputs, strict=True):
            assert h.token_ids[1:6] == [5, 6, 7, 5, 6] and h.token_ids[7:9] == [7, 6]
            assert h.token_ids[0] in (8, 9) and h.token_ids[6] in (3, 4)
            assert h.finish_reason == "stop"
    # Greedy: the model chose the same at each choice (the forced tokens are what the mask would
    # have let it sample); the seeded sampled rows draw from the same distributions, not the same
    # random numbers (fewer draws), so only their shape is fixed above.
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert got[0].outputs[0].text == expected[0].outputs[0].text
    assert jump_steps.generated == plain_steps.generated  # every output token counted once
    assert jump_steps.steps <= plain_steps.steps - 5  # 11 vs 6 when written
    assert not jumping.engine.structured_output._matchers
    assert jumping.engine.scheduler.kv_cache_manager.stats().blocks_used == 0


def test_a_request_with_logprobs_is_sampled_token_by_token(tmp_path):
    regex = StructuredOutputParams(GrammarKind.REGEX, "w9w5w6w7")
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_output=regex, logprobs=1)
    llm, steps = _tiny_llm(tmp_path)
    out = llm.generate("w5", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:4] == [9, 5, 6, 7]
    assert len(out.logprobs) == len(out.token_ids) and all(entry is not None for entry in out.logprobs)
    assert steps.steps >= 4


def test_forced_text_stops_at_max_tokens(tmp_path):
    regex = StructuredOutputParams(GrammarKind.REGEX, "(w8|w9)w5w6w7w5w6w7")
    llm, _ = _tiny_llm(tmp_path)
    out = llm.generate("w5", SamplingParams(temperature=0.0, max_tokens=4, structured_output=regex),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[1:] == [5, 6, 7] and out.finish_reason == "length"
    assert llm.engine.scheduler.kv_cache_manager.stats().blocks_used == 0


@pytest.mark.slow
def test_the_default_model_writes_a_forced_tool_call_wrapper_in_whole_tokens():
    # The wrapper pydantic-ai's tool_choice "required" forces: without jumping the model spells
    # it in whatever fragments the mask allows; with it, in the tokenizer's own tokens.
    schema = {"type": "array", "minItems": 1, "maxItems": 1, "items": {
        "type": "object", "properties": {"name": {"const": "final_result"},
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                                        "required": ["city"], "additionalProperties": False}},
        "required": ["name", "parameters"], "additionalProperties": False}}
    constraint = StructuredOutputParams(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_output=constraint)
    results = {}
    for jump in (False, True):
        llm = LLM(dtype="float32", enforce_eager=True, jump_forward=jump, num_kv_blocks=64, max_model_len=1024)
        steps = _Steps()
        llm.engine.stats_listeners.append(steps)
        prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Which city is the Eiffel tower in?"}])
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        value = json.loads(out.text)
        assert value[0]["name"] == "final_result" and isinstance(value[0]["parameters"]["city"], str)
        results[jump] = (len(out.token_ids), steps.steps)
        llm.close()
    (plain_tokens, plain_steps), (jump_tokens, jump_steps) = results[False], results[True]
    assert jump_tokens <= plain_tokens and jump_steps < plain_steps, results

