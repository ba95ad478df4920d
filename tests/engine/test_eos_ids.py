"""Every end-of-generation id stops a request (issue 13): a tiny model whose config.json names one
EOS and whose generation_config.json lists two more stops on any of them; min_tokens holds all of
them back and ignore_eos ignores all of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.model.model_config import end_of_generation_ids
from kvserve.engine.model.registry import load_model_config
from tests.engine.tiny_model_dir import TOKENIZER_EOS, write_tiny_model

PROMPTS = ["w5 w6 w7", "w9 w10", "w40 w41 w42 w43"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def free_running(tmp_path_factory) -> list[list[int]]:
    """Greedy outputs of the plain model, never stopping: the reference for where stops fall."""
    llm = LLM(str(write_tiny_model(tmp_path_factory.mktemp("plain") / "m")), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def extra_eos(free_running) -> tuple[int, int]:
    """Two ids the free-running outputs reach early, from different prompts."""
    first = free_running[0][3]
    second = next(t for t in free_running[2][2:] if t not in (first, TOKENIZER_EOS))
    return first, second


@pytest.fixture(scope="module")
def multi_eos_llm(tmp_path_factory, extra_eos) -> LLM:
    path = write_tiny_model(tmp_path_factory.mktemp("multi") / "m",
                            generation_config={"eos_token_id": [TOKENIZER_EOS, *extra_eos]})
    return LLM(str(path), dtype="float32", num_kv_blocks=64)


def test_config_lists_every_eos_id(multi_eos_llm, extra_eos):
    assert multi_eos_llm.engine.eos_token_ids == (TOKENIZER_EOS, *extra_eos)


def test_generation_stops_on_any_eos_id(multi_eos_llm, free_running, extra_eos):
    eos = {TOKENIZER_EOS, *extra_eos}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = multi_eos_llm.generate(PROMPTS, params, use_tqdm=False)
    stopped_on = set()
    for reference, output in zip(free_running, outputs):
        completion = output.outputs[0]
        end = next((i + 1 for i, t in enumerate(reference) if t in eos), len(reference))
        assert completion.token_ids == reference[:end]
        if end < len(reference) or reference[-1] in eos:
            assert completion.finish_reason == "stop"
            stopped_on.add(completion.token_ids[-1])
    # Both extra ids (not only the tokenizer's EOS) ended some request.
    assert set(extra_eos) <= stopped_on


def test_min_tokens_holds_back_every_eos_id(multi_eos_llm, extra_eos):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=8)
    for output in multi_eos_llm.generate(PROMPTS, params, use_tqdm=False):
        tokens = output.outputs[0].token_ids
        assert len(tokens) >= 8
        assert not {TOKENIZER_EOS, *extra_eos} & set(tokens[:8])


def test_ignore_eos_ignores_every_eos_id(multi_eos_llm, free_running):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = multi_eos_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == free_running
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_end_of_generation_ids_puts_the_tokenizer_eos_first_without_duplicates(tmp_path: Path):
    config = load_model_config(write_tiny_model(tmp_path / "m", eos_token_id=[7, 2],
                                                generation_config={"eos_token_id": [2, 9]}))
    assert config.eos_token_ids == (7, 2, 9)
    assert end_of_generation_ids(config, 2) == (2, 7, 9)
    assert end_of_generation_ids(config, None) == (7, 2, 9)
