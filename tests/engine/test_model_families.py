"""Qwen3, Phi-3 (Phi-4-mini's partial rotary and LongRoPE), Gemma 3 (local and global layers, a
rope per kind, four (1 + w) norms per block, GeGLU, scaled embeddings), Gemma 2 (alternating
local and global layers, attention-logit and final-logit soft-capping) and Llama 3.x's rope
scaling (tests/engine/tiny_families.py): each tiny random model loads from its HF folder and from a GGUF
written as llama.cpp's converter lays it out; its logits equal transformers' in float32 through the
paged cache (within TOLERANCE), and its greedy tokens equal transformers' (exact, up to near-ties)
through the engine under plain batching of 16 concurrent requests, preemption, chunked prefill
and prefix hits.

Phi-3's LongRoPE applies its long factors to a model whose context reaches past its original
pretraining length (64 tokens here), as llama.cpp decides once from the context; transformers
decides per forward from the longest position in it. The two agree once a sequence is longer than
the original context, so every prompt here is (65 tokens and up).

Gemma 3's and Gemma 2's local layers' window (tiny_families.GEMMA3_WINDOW, 32) is a fraction of
every prompt: their local and global layers form layer groups, the local ones giving back blocks
that leave the window. transformers runs its eager attention, the one that applies Gemma 2's
attention soft-cap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource
from kvserve.kernels import TorchAttentionBackend
from tests.engine.conftest import PagedDriver, PagedSequence, transformers_greedy, transformers_logits
from tests.engine.greedy_check import near_tie_divergences
from tests.engine.tiny_families import write_llama_cpp_gguf, write_tiny_model

FAMILIES = ("qwen3", "phi3", "llama3", "gemma3", "gemma2")
TOLERANCE = 1e-3  # max |logit difference| in float32 (the Llama family's bound)
MAX_NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, hf_smollm2_tokenizer) -> dict[str, Path]:
    return {name: write_tiny_model(name, tmp_path_factory.mktemp(f"tiny-{name}"), hf_smollm2_tokenizer, seed=i)
            for i, name in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def references(tiny_dirs) -> dict:
    return {name: _reference(path) for name, path in tiny_dirs.items()}


def _reference(path: Path, **config_overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                **config_overrides).eval()


def _random_prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


# 16 prompts of 65-130 tokens; the last four share a 48-token (three-block) prefix.
SHARED = _random_prompts(49152, (48,), seed=7)[0]
PROMPTS = _random_prompts(49152, tuple(65 + 5 * i for i in range(12)), seed=1) + [
    SHARED + tail for tail in _random_prompts(49152, (20, 25, 30, 35), seed=2)]


def assert_logits_match(source: ModelSource, reference, lengths: tuple[int, ...], decode_steps: int = 4) -> None:
    """Prefill of several requests in one flattened batch over shuffled blocks, then decode steps."""
    config, model = load_model(source, torch.float32, torch.device("cpu"))
    prompts = _random_prompts(config.vocab_size, lengths)
    driver = PagedDriver(model, config, TorchAttentionBackend(), num_blocks=64)
    seqs = [PagedSequence(list(p)) for p in prompts]
    ours = driver.step(seqs, [len(p) for p in prompts])
    for step in range(decode_steps):
        for seq in seqs:
            seq.token_ids.append((7 * step + len(seq.token_ids)) % config.vocab_size)
        ours = [torch.cat([o, d]) for o, d in zip(ours, driver.step(seqs, [1] * len(seqs)))]
    for seq, logits in zip(seqs, ours):
        diff = (logits - transformers_logits(reference, seq.token_ids)).abs().max().item()
        assert diff <= TOLERANCE, f"{source}: max |logit diff| {diff:.2e} over {len(seq.token_ids)} tokens"


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_folder_and_llama_cpp_gguf_logits_match_transformers(name, tiny_dirs, references, tmp_path):
    path = tiny_dirs[name]
    lengths = (70, 90, 66)
    assert_logits_match(ModelSource("hf", path), references[name], lengths)
    assert_logits_match(ModelSource("gguf", write_llama_cpp_gguf(path, tmp_path / f"{name}.gguf")),
                        references[name], lengths)


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_gemma2_soft_caps_bite_on_the_tiny_model(cap, tiny_dirs, references):
    # Else the logits tests could not tell a backend that skips a cap from one that applies it.
    prompt = _random_prompts(49152, (90,))[0]
    uncapped = _reference(tiny_dirs["gemma2"], **{cap: None})
    difference = (transformers_logits(uncapped, prompt) - transformers_logits(references["gemma2"], prompt)).abs().max()
    assert difference > 100 * TOLERANCE


@pytest.mark.parametrize("name", FAMILIES)
def test_llama_cpp_gguf_greedy_tokens_match_transformers(name, tiny_dirs, references, tmp_path):
    config, model = load_model(ModelSource("gguf", write_llama_cpp_gguf(tiny_dirs[name], tmp_path / "m.gguf")),
                               torch.float32, torch.device("cpu"))
    prompts = PROMPTS[:4]
    ours = PagedDriver(model, config, TorchAttentionBackend(), num_blocks=64).greedy(prompts, MAX_NEW_TOKENS)
    near_ties = near_tie_divergences(ours, transformers_greedy(references[name], prompts, MAX_NEW_TOKENS))
    assert len(near_ties) <= 1, near_ties


@pytest.fixture(scope="module")
def greedy_references(references) -> dict:
    return {name: transformers_greedy(model, PROMPTS, MAX_NEW_TOKENS) for name, model in references.items()}


REGIMES = {
    "batched": {},
    "preemption": {"num_kv_blocks": 12},  # 16 requests of 5-10 blocks each (6-10 at the end) in 12
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "prefix-hits": {"enable_prefix_caching": True},
}


@pytest.mark.slow
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_tokens_match_transformers(name, regime, tiny_dirs, greedy_references):
    options = {"num_kv_blocks": 256, "enable_prefix_caching": False, **REGIMES[regime]}
    if regime == "preemption" and name == "gemma3":
        # Its 5 local layers and 1 global one form 6 one-layer groups sharing the pool; with
        # 64-token steps a request holds at most 10 global + 5 x 7 local blocks.
        options |= {"num_kv_blocks": 48, "max_num_batched_tokens": 64}
    if regime == "preemption" and name == "gemma2":  # 2 local + 2 global one-layer groups: 2 x 10 + 2 x 7
        options |= {"num_kv_blocks": 36, "max_num_batched_tokens": 64}
    llm = LLM(str(tiny_dirs[name]), dtype="float32", enforce_eager=True, max_model_len=160, **options)
    if regime == "prefix-hits":  # the first shared-prefix prompt fills the cache; the other three reuse it
        llm.generate([PROMPTS[12]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    near_ties = near_tie_divergences([o.outputs[0].token_ids for o in outputs], greedy_references[name])
    assert len(near_ties) <= 2, near_ties
    manager = llm.engine.scheduler.kv_cache_manager
    assert manager.stats().blocks_used == 0, "blocks still held after every request finished"
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    if regime == "prefix-hits":
        assert manager.stats().prefix_cache_hits >= 3 * 48, "the three later shared-prefix prompts should hit"
