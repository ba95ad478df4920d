"""Mistral served with its sliding window: a tiny random-weight MistralForCausalLM (window 32,
GQA 4:2, seeded, saved as a HF folder) gives transformers' float32 greedy tokens over prompts
several windows long, with the batch as it comes, under preemption, chunked prefill (chunks
shorter and longer than the window) and prefix hits; its window layers' cache holds at most
ceil(w/16)+1 blocks per request whatever its length, and nothing is left held at the end."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.output_tracker import child_request_id
from kvserve.paging import SlidingWindowSpec
from tests.engine.conftest import transformers_greedy
from tests.engine.greedy_check import near_tie_divergences
from tests.engine.tiny_model_dir import write_word_tokenizer

WINDOW = 32
VOCAB = 128
MAX_NEW_TOKENS = 24
# Several windows long (and one shorter than a window), all sharing a 100-token prefix but one.
SHARED = [random.Random(0).randrange(3, VOCAB) for _ in range(100)]
PROMPTS = [SHARED + [random.Random(n).randrange(3, VOCAB) for _ in range(length)]
           for n, length in enumerate((5, 40, 77, 130))] + [[5, 6, 7, 8, 9, 10, 11], list(range(3, 3 + 90))]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    import transformers

    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, sliding_window=WINDOW, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-mistral-window")
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def references(mistral_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32)
    assert model.config.sliding_window == WINDOW
    return transformers_greedy(model.eval(), PROMPTS, MAX_NEW_TOKENS)


def full_attention_greedy(mistral_dir):
    """transformers' greedy for the same weights without the window: what a server that ignored
    it would answer (the check that the prompts are long enough for the window to matter)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32, sliding_window=None)
    return transformers_greedy(model.eval(), PROMPTS, MAX_NEW_TOKENS)


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache_manager.stats().blocks_used == 0, "blocks still held after every request finished"
    return [o.outputs[0].token_ids for o in outputs]


def assert_matches(llm: LLM, references) -> None:
    near_ties = near_tie_divergences(generate(llm), references)
    assert len(near_ties) <= 1, near_ties


def test_the_window_is_served_and_matches_transformers(mistral_dir, references):
    llm = LLM(str(mistral_dir), dtype="float32", enforce_eager=True, num_kv_blocks=256)
    specs = [group.spec for group in llm.engine.executor.driver.kv_cache_config.groups]
    assert specs and all(isinstance(spec, SlidingWindowSpec) and spec.sliding_window == WINDOW for spec in specs)
    assert llm.engine.max_model_len == 2048  # the whole context, not capped at the window
    assert_matches(llm, references)
    # Without the window the same weights answer otherwise: the prompts do reach past it.
    unwindowed = [r.token_ids for r in full_attention_greedy(mistral_dir)]
    assert unwindowed != [r.token_ids for r in references]


def test_preemption_under_a_tiny_pool_matches_transformers(mistral_dir, references):
    # 2 layers in one window group: ceil(31/16)+1 = 3 blocks hold a decoding request; 12 blocks
    # for six requests of up to 250 tokens force preemption.
    llm = LLM(str(mistral_dir), dtype="float32", enforce_eager=True, num_kv_blocks=12, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    assert_matches(llm, references)
    assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"


@pytest.mark.parametrize("chunk", [16, 48])
def test_chunked_prefill_shorter_and_longer_than_the_window_matches_transformers(mistral_dir, references, chunk):
    llm = LLM(str(mistral_dir), dtype="float32", enforce_eager=True, max_num_batched_tokens=chunk, num_kv_blocks=256)
    assert_matches(llm, references)


def test_prefix_hits_serve_the_window_and_match_transformers(mistral_dir, references):
    llm = LLM(str(mistral_dir), dtype="float32", enforce_eager=True, enable_prefix_caching=True, num_kv_blocks=256)
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # fills the cache
    assert_matches(llm, references)
    assert llm.engine.scheduler.kv_cache_manager.stats().prefix_cache_hits >= 3 * 96, \
        "the later shared-prefix prompts should hit the cache"


def test_one_request_of_twenty_windows_holds_a_window_of_blocks_from_the_first_window_on(mistral_dir):
    # 2048 tokens of context in 8 blocks: a window of 3 and one 64-token step's worth beside it
    # (the scheduler's budget bounds a step; a 2048-token step would need them all).
    llm = LLM(str(mistral_dir), dtype="float32", enforce_eager=True, num_kv_blocks=8, max_num_batched_tokens=64)
    engine, manager = llm.engine, llm.engine.scheduler.kv_cache_manager
    cap = math.ceil(WINDOW / 16) + 1
    prompt = PROMPTS[1][:40]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=20 * WINDOW - len(prompt),
                                                      ignore_eos=True))
    held, generated = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():  # each step reports its new tokens only
            generated += sum(len(completion.token_ids) for completion in output.outputs)
        held.append(sum(block is not None for block in manager.block_ids(child_request_id("long", 0), 0)))
    assert len(prompt) + generated == 20 * WINDOW
    # The prompt (40 tokens) is past the first window already: every step holds at most the cap.
    during = [count for count in held if count]
    assert len(during) >= 20 * WINDOW - len(prompt) - 1
    assert max(during) == cap  # 3 for w = 32, of the 40 blocks a full-attention cache would hold
    assert manager.stats().blocks_used == 0


@pytest.mark.slow
def test_the_compiled_forward_serves_the_window_and_matches_transformers(mistral_dir, references):
    # The window reaches the compiled layers as a symbolic int of their step metadata.
    llm = LLM(str(mistral_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=48)
    assert llm.engine.executor.driver.runner.compiled
    assert_matches(llm, references)
