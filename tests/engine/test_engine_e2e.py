"""End to end with SmolLM2 in float32: kvserve's greedy outputs equal transformers' generate for
16 prompts of mixed lengths submitted together, under every scheduling regime that changes how
the KV cache is filled (issue 5), with the compiled forward and with --enforce-eager (issue 12).
The layers compile once per process; later engines reuse the compiled graphs."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from tests.engine.conftest import ReferenceGreedy, transformers_greedy
from tests.engine.greedy_check import near_tie_divergences

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32
SHARED_PREFIX = (
    "The paged KV cache splits memory into fixed blocks of sixteen tokens. A block table maps each "
    "request's logical blocks to physical ones, so a request's cache never has to be contiguous. "
)
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4, 5,",
    "Translate to French: I like apples. ->",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1969, the first humans landed on",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "Write a haiku about the sea:\n",
    "The three primary colors are",
    SHARED_PREFIX + "Why does paging reduce waste?",
    SHARED_PREFIX + "What is a block table?",
    SHARED_PREFIX + "Summarise this in one sentence:",
    SHARED_PREFIX + "How large is a block?",
]


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(params=[False, True], ids=["compiled", "eager"])
def enforce_eager(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def prompt_ids(default_llm: LLM) -> list[list[int]]:
    tokenizer = default_llm.get_tokenizer()
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(hf_smollm2, prompt_ids) -> list[ReferenceGreedy]:
    return transformers_greedy(hf_smollm2, prompt_ids, MAX_NEW_TOKENS)


def assert_matches_transformers(llm: LLM, prompt_ids, references) -> None:
    # Plain greedy, as the reference: no stopping at EOS.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    near_ties = near_tie_divergences([o.outputs[0].token_ids for o in outputs], references)
    assert len(near_ties) <= 2, near_ties
    assert llm.engine.scheduler.kv_cache_manager.stats().blocks_used == 0, "blocks still held after every request finished"


def test_default_settings_match_transformers(default_llm, prompt_ids, references):
    assert default_llm.engine.executor.driver.runner.compiled, "the default on CPU is the compiled forward"
    assert_matches_transformers(default_llm, prompt_ids, references)


def test_enforce_eager_matches_transformers(prompt_ids, references):
    llm = LLM(dtype="float32", enforce_eager=True)
    assert not llm.engine.executor.driver.runner.compiled
    assert_matches_transformers(llm, prompt_ids, references)


def test_preemption_under_a_tiny_kv_pool_matches_transformers(prompt_ids, references, enforce_eager):
    llm = LLM(dtype="float32", num_kv_blocks=24, max_model_len=256, enforce_eager=enforce_eager)
    assert_matches_transformers(llm, prompt_ids, references)
    assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"


def test_sixteen_token_prefill_chunks_match_transformers(prompt_ids, references, enforce_eager):
    llm = LLM(dtype="float32", max_num_batched_tokens=16, enforce_eager=enforce_eager)
    assert_matches_transformers(llm, prompt_ids, references)


def test_prefix_caching_hits_and_matches_transformers(prompt_ids, references, enforce_eager):
    llm = LLM(dtype="float32", enable_prefix_caching=True, enforce_eager=enforce_eager)
    # The first shared-prefix prompt fills the cache; the rest of the batch then reuses its blocks.
    llm.generate([prompt_ids[12]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert_matches_transformers(llm, prompt_ids, references)
    stats = llm.engine.scheduler.kv_cache_manager.stats()
    assert stats.prefix_cache_hits >= 3 * 16, "the three later shared-prefix prompts should hit the cache"


def test_seeded_sampling_is_reproducible_across_batches(default_llm, prompt_ids):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = default_llm.generate([prompt_ids[3]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=24)] * 5
    batch = default_llm.generate(prompt_ids[:6], others[:3] + [params] + others[3:5], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone


def test_fp8_kv_cache_stores_e4m3_and_keeps_the_first_greedy_tokens(prompt_ids, references):
    """fp8 KV costs accuracy (benchmarks/fp8_kv_accuracy.py measures how much); the first token
    after the prompt must still mostly agree with transformers'."""
    llm = LLM(dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=256, max_model_len=512)
    key_cache, value_cache = llm.engine.executor.driver.runner.kv_caches[0]
    assert key_cache.dtype == value_cache.dtype == torch.float8_e4m3fn
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    agree = sum(o.outputs[0].token_ids[0] == r.token_ids[0] for o, r in zip(outputs, references))
    assert agree >= 12, f"only {agree}/16 first tokens agree with transformers"


@pytest.fixture(scope="module")
def int8_greedy(prompt_ids) -> list[list[int]]:
    """int8 KV with every request admitted at once: the reference for the regimes below."""
    llm = LLM(dtype="float32", kv_cache_dtype="int8", enforce_eager=True)
    key_cache, value_cache, key_scales, value_scales = llm.engine.executor.driver.runner.kv_caches[0]
    assert key_cache.dtype == value_cache.dtype == torch.int8
    assert key_scales.shape == (*key_cache.shape[:3], 4)  # a float32 scale per token and KV head, as page bytes
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]


def test_int8_kv_cache_keeps_the_greedy_tokens(int8_greedy, references):
    """A scale per token and head keeps ~2^-8 of each row's range: the continuations stay
    transformers' far longer than fp8's (benchmarks/fp8_kv_accuracy.py measures how much)."""
    first = sum(tokens[0] == r.token_ids[0] for tokens, r in zip(int8_greedy, references))
    identical = sum(tokens == r.token_ids for tokens, r in zip(int8_greedy, references))
    # Measured against kvserve's float32 run (benchmarks/fp8_kv_accuracy.py, 32 tokens): int8 10/16 identical, fp8 2/16.
    assert first >= 14 and identical >= 6, f"{first}/16 first tokens, {identical}/16 continuations agree"


def test_int8_kv_cache_under_chunked_prefill_prefix_hits_and_preemption(prompt_ids, int8_greedy):
    """Compiled, 16-token chunks, a tiny pool (preemption), the shared prefix cached: the scales
    travel with their blocks, so the tokens are the plain int8 run's and no block leaks."""
    llm = LLM(dtype="float32", kv_cache_dtype="int8", max_num_batched_tokens=16, num_kv_blocks=24, max_model_len=256)
    llm.generate([prompt_ids[12]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]
    differ = [n for n, (ours, plain) in enumerate(zip(outputs, int8_greedy)) if ours != plain]
    # Chunked math rounds differently in the last bits, which can move an int8 code by one and so
    # flip a near-tie (measured: 15 of 16 identical, the other parting at its 7th token).
    assert len(differ) <= 2, f"prompts {differ} differ from the plain int8 run"
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    stats = scheduler.kv_cache_manager.stats()
    assert stats.prefix_cache_hits >= 3 * 16 and stats.blocks_used == 0
