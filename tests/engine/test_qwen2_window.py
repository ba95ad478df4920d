"""Qwen2 served with its sliding window as transformers serves it (use_sliding_window: the layers
from max_window_layers on attend within the window, the others to everything): a tiny seeded
Qwen2ForCausalLM (4 layers, the upper 2 in a 32-token window, GQA 4:2) gives transformers'
float32 logits through the paged cache and its greedy tokens through the engine over prompts
several windows long, with the batch as it comes and under chunked prefill with preemption; its
window layers form their own cache group. A windowed Qwen3 reads the same fields, to
transformers' logits. Shipped Qwen2 configs (use_sliding_window false) are
served as before, without a window."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model.registry import load_model_config, model_config_from_hf_dict
from kvserve.kernels import TorchAttentionBackend
from kvserve.paging import FullAttentionSpec, SlidingWindowSpec
from tests.engine.conftest import PagedDriver, PagedSequence, transformers_greedy, transformers_logits
from tests.engine.greedy_check import near_tie_divergences
from tests.engine.tiny_model_dir import write_word_tokenizer

WINDOW = 32
VOCAB = 128
LAYERS, MAX_WINDOW_LAYERS = 4, 2  # layers 2 and 3 windowed
TOLERANCE = 1e-3
MAX_NEW_TOKENS = 16
SHARED = [random.Random(0).randrange(3, VOCAB) for _ in range(100)]
PROMPTS = [SHARED + [random.Random(n).randrange(3, VOCAB) for _ in range(length)]
           for n, length in enumerate((5, 40, 77, 130))] + [[5, 6, 7, 8, 9, 10, 11], list(range(3, 3 + 90))]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=MAX_WINDOW_LAYERS, initializer_range=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-qwen2-window")
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return path


def _transformers(qwen2_dir, **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32, **overrides).eval()


@pytest.fixture(scope="module")
def reference(qwen2_dir):
    return _transformers(qwen2_dir)


@pytest.fixture(scope="module")
def references(reference):
    return transformers_greedy(reference, PROMPTS, MAX_NEW_TOKENS)


def assert_logits_match(path, reference) -> None:
    config, model = load_model(ModelSource("hf", path), torch.float32, torch.device("cpu"))
    driver = PagedDriver(model, config, TorchAttentionBackend(), num_blocks=96)
    seqs = [PagedSequence(list(p)) for p in PROMPTS[1:4]]
    ours = driver.step(seqs, [len(s.token_ids) for s in seqs])
    for step in range(3):
        for seq in seqs:
            seq.token_ids.append((5 * step + len(seq.token_ids)) % VOCAB)
        ours = [torch.cat([o, d]) for o, d in zip(ours, driver.step(seqs, [1] * len(seqs)))]
    for seq, logits in zip(seqs, ours):
        diff = (logits - transformers_logits(reference, seq.token_ids)).abs().max().item()
        assert diff <= TOLERANCE, f"max |logit diff| {diff:.2e} over {len(seq.token_ids)} tokens"


def test_the_upper_layers_are_windowed_and_the_logits_match_transformers(qwen2_dir, reference):
    config = load_model_config(qwen2_dir)
    assert [config.layer_window(i) for i in range(LAYERS)] == [None, None, WINDOW, WINDOW]
    assert config.max_position_embeddings == 2048  # the whole context, not capped at the window
    assert (config.kv_shape().sliding_window, config.kv_shape().num_window_layers) == (WINDOW, 2)
    assert_logits_match(qwen2_dir, reference)


def test_a_windowed_qwen3_reads_the_same_fields_and_matches_transformers_logits(tmp_path):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
        initializer_range=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    assert [load_model_config(tmp_path).layer_window(i) for i in range(2)] == [None, WINDOW]
    assert_logits_match(tmp_path, _transformers(tmp_path))


def test_engine_greedy_matches_transformers_and_the_window_matters(qwen2_dir, references):
    llm = LLM(str(qwen2_dir), dtype="float32", enforce_eager=True, num_kv_blocks=256)
    specs = [group.spec for group in llm.engine.executor.driver.kv_cache_config.groups]
    assert {type(s) for s in specs} == {SlidingWindowSpec, FullAttentionSpec}
    assert all(s.sliding_window == WINDOW for s in specs if isinstance(s, SlidingWindowSpec))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert len(near_tie_divergences(ours, references)) <= 1
    # Without the window the same weights answer otherwise: the prompts do reach past it.
    full = _transformers(qwen2_dir, layer_types=["full_attention"] * LAYERS)
    unwindowed = transformers_greedy(full, PROMPTS, MAX_NEW_TOKENS)
    assert [r.token_ids for r in unwindowed] != [r.token_ids for r in references]


@pytest.mark.slow
def test_chunked_prefill_under_preemption_matches_transformers(qwen2_dir, references):
    llm = LLM(str(qwen2_dir), dtype="float32", enforce_eager=True, num_kv_blocks=24, max_num_batched_tokens=16,
              enable_prefix_caching=False, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert len(near_tie_divergences(ours, references)) <= 1
    assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    assert llm.engine.scheduler.kv_cache_manager.stats().blocks_used == 0


QWEN25_7B_INSTRUCT = {  # as shipped: use_sliding_window false, so its sliding_window means nothing
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}


def test_shipped_qwen2_configs_keep_full_attention_and_layer_types_pick_the_windowed_layers():
    shipped = model_config_from_hf_dict(QWEN25_7B_INSTRUCT)
    assert shipped.sliding_window is None and shipped.max_position_embeddings == 32768
    assert all(shipped.layer_window(i) is None for i in range(28)) and shipped.kv_shape().num_window_layers == 0
    windowed = {**QWEN25_7B_INSTRUCT, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    config = model_config_from_hf_dict(windowed)
    assert [i for i in range(28) if config.layer_window(i)] == list(range(20, 28))
    # transformers 5 writes layer_types, which win over max_window_layers.
    kinds = ["sliding_attention" if i % 2 else "full_attention" for i in range(28)]
    config = model_config_from_hf_dict({**windowed, "layer_types": kinds})
    assert [i for i in range(28) if config.layer_window(i)] == list(range(1, 28, 2))
    # Every layer below max_window_layers: no window at all.
    assert model_config_from_hf_dict({**windowed, "max_window_layers": 28}).sliding_window is None
