"""Greedy 64-token continuations equal transformers' for 8 prompts decoded together, token by
token, through the paged cache with shuffled block tables (issue 2).

Batched float32 math may differ from transformers' in the last bits, so the two may part ways
where transformers' top two logits are within NEAR_TIE: such a divergence is reported as a
warning naming the prompt, step and gap (and counted); any other divergence fails.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import PagedDriver, transformers_greedy
from tests.engine.greedy_check import near_tie_divergences

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "Once upon a time, in a land far away, there lived a",
    "1, 1, 2, 3, 5, 8, 13,",
    "Q: Why is the sky blue?\nA:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1969, the first humans landed on",
    "Write a haiku about the sea:\n",
]
CHAT = [{"role": "user", "content": "Give me three tips for writing clear Python code."}]


@pytest.fixture(scope="module")
def prompt_ids(hf_smollm2_tokenizer) -> list[list[int]]:
    chat = hf_smollm2_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat)
    return [hf_smollm2_tokenizer.encode(p) for p in PROMPTS] + [chat_ids]


def test_greedy_continuations_match_transformers(our_smollm2, hf_smollm2, prompt_ids, attention_backend):
    config, model = our_smollm2
    assert len(prompt_ids) >= 8
    driver = PagedDriver(model, config, attention_backend, num_blocks=96, seed=3)
    ours = driver.greedy(prompt_ids, MAX_NEW_TOKENS)
    references = transformers_greedy(hf_smollm2, prompt_ids, MAX_NEW_TOKENS)
    assert all(len(tokens) == MAX_NEW_TOKENS for tokens in ours)
    near_ties = near_tie_divergences(ours, references)
    # A near-tie is rare; if most prompts need the excuse, something is numerically off.
    assert len(near_ties) <= 2, near_ties
