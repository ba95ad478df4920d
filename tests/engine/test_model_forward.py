"""Our forward equals transformers' in float32, through the paged cache (issue 2).

Every comparison runs several requests in one flattened batch whose block tables are shuffled
and interleaved, so a wrong slot, block-table lookup or query offset shows up as a logit error.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource
from tests.engine.conftest import TINY_ARCHITECTURES, PagedDriver, PagedSequence, transformers_logits

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3  # max abs logit difference, float32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Emoji 🙂 and 中文 and   odd\twhitespace\n\n",
    "Once upon a time, in a land far away, there lived a dragon who collected paged key-value caches "
    "and block tables. Every night the dragon counted its blocks: sixteen tokens each, never contiguous,",
]


@pytest.fixture(scope="module")
def prompt_ids(hf_smollm2_tokenizer) -> list[list[int]]:
    ids = [hf_smollm2_tokenizer.encode(p) for p in PROMPTS]
    assert any(len(p) > 32 for p in ids), "one prompt must span several blocks"
    return ids


def test_smollm2_gguf_prefill_logits_match_transformers(our_smollm2, hf_smollm2, prompt_ids, attention_backend):
    config, model = our_smollm2
    driver = PagedDriver(model, config, attention_backend, num_blocks=64)
    seqs = [PagedSequence(p) for p in prompt_ids]
    ours = driver.step(seqs, [len(p) for p in prompt_ids])
    for prompt, logits in zip(prompt_ids, ours):
        diff = (logits - transformers_logits(hf_smollm2, prompt)).abs().max().item()
        assert diff <= TOLERANCE, f"max |logit diff| {diff:.2e} for prompt of {len(prompt)} tokens"


def test_smollm2_chunked_prefill_mixed_with_decode(our_smollm2, hf_smollm2, prompt_ids, attention_backend):
    """A prompt computed in three uneven chunks while another request decodes beside it gives
    the same logits as one full forward: earlier chunks are read back from the cache."""
    config, model = our_smollm2
    driver = PagedDriver(model, config, attention_backend, num_blocks=64, seed=1)
    long_prompt, short_prompt = prompt_ids[3], prompt_ids[0]
    chunks = [5, 17, len(long_prompt) - 22]
    decoding = PagedSequence(short_prompt + [13, 314])
    chunked = PagedSequence(long_prompt)
    driver.step([decoding], [len(short_prompt)])
    chunk_logits, decode_logits = [], []
    for i, size in enumerate(chunks):
        if i < 2:  # the other request decodes one token alongside the first two chunks
            chunk_out, decode_out = driver.step([chunked, decoding], [size, 1])
            decode_logits.append(decode_out)
        else:
            (chunk_out,) = driver.step([chunked], [size])
        chunk_logits.append(chunk_out)
    diff = (torch.cat(chunk_logits) - transformers_logits(hf_smollm2, long_prompt)).abs().max().item()
    assert diff <= TOLERANCE, f"chunked prefill differs by {diff:.2e}"
    ref_decode = transformers_logits(hf_smollm2, decoding.token_ids)[len(short_prompt):]
    diff = (torch.cat(decode_logits) - ref_decode).abs().max().item()
    assert diff <= TOLERANCE, f"decode rows batched with prefill chunks differ by {diff:.2e}"


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_tiny_hf_checkpoint_logits_match_transformers(architecture, tiny_checkpoints, attention_backend):
    """Random tiny checkpoints (llama3 rope scaling, linear scaling + tied embeddings, Qwen2 qkv
    bias, Mistral) load from safetensors and match transformers over prefill and decode."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints[architecture]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config, model = load_model(ModelSource("hf", path), torch.float32, torch.device("cpu"))
    assert config.tie_word_embeddings == (architecture == "llama-tied-linear")
    assert config.attention_bias == (architecture == "qwen2")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (3, 40, 90)]
    driver = PagedDriver(model, config, attention_backend, num_blocks=48)
    seqs = [PagedSequence(list(p)) for p in prompts]
    ours = driver.step(seqs, [len(p) for p in prompts])
    # Then 5 decode steps (positions beyond llama3's original 64-token context for the long ones).
    for step in range(5):
        for seq in seqs:
            seq.token_ids.append((7 * step + len(seq.token_ids)) % config.vocab_size)
        decoded = driver.step(seqs, [1] * len(seqs))
        ours = [torch.cat([o, d]) for o, d in zip(ours, decoded)]
    for seq, logits in zip(seqs, ours):
        ref = transformers_logits(reference, seq.token_ids)
        diff = (logits - ref).abs().max().item()
        assert diff <= TOLERANCE, f"{architecture}: max |logit diff| {diff:.2e} over {len(seq.token_ids)} tokens"


def test_dynamic_ntk_rope_matches_transformers_token_by_token_decode(tiny_checkpoints, attention_backend):
    """Dynamic NTK scaling rotates each token by its own position's frequencies, which is what
    transformers does when it decodes token by token past max_position_embeddings (32 here)."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["llama-dynamic"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config, model = load_model(ModelSource("hf", path), torch.float32, torch.device("cpu"))
    assert config.rope_scaling["rope_type"] == "dynamic"
    tokens = torch.randint(0, config.vocab_size, (56,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt_len = 20
    seq = PagedSequence(tokens)
    driver = PagedDriver(model, config, attention_backend, num_blocks=8)
    ours = [driver.step([seq], [prompt_len])[0][-1]] + [driver.step([seq], [1])[0][-1]
                                                       for _ in range(len(tokens) - prompt_len)]
    ref, past = [], None
    with torch.inference_mode():
        out = reference(input_ids=torch.tensor([tokens[:prompt_len]]), use_cache=True)
        ref.append(out.logits[0, -1])
        for token in tokens[prompt_len:]:
            out = reference(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            ref.append(out.logits[0, -1])
    diff = (torch.stack(ours) - torch.stack(ref)).abs().max().item()
    assert diff <= TOLERANCE, f"dynamic rope: max |logit diff| {diff:.2e} up to position {len(tokens) - 1}"
