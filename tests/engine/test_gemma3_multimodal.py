"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration, the 4B/12B/27B models) served
as their text model: a tiny seeded one built from transformers' Gemma3Config (a tiny text_config
with a 32-token window, a tiny SigLIP vision_config) saved as a HF folder gives transformers'
float32 text logits through the paged cache and its greedy tokens through the engine; older
transformers' weight names load alike; the vision tower and projector are never read; llama.cpp's
text GGUF of such a checkpoint (the `gemma3` architecture, as 1B's) loads to the same logits; the
shipped config.json of google/gemma-3-4b-it and -27b-it parse to their models' shape."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.model.gemma3_multimodal import RENAMES
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model.registry import model_config_from_hf_dict
from kvserve.engine.model.safetensors_checkpoint import SafetensorsCheckpoint
from kvserve.kernels import TorchAttentionBackend
from kvserve.paging import FullAttentionSpec, SlidingWindowSpec
from tests.engine.conftest import PagedDriver, PagedSequence, transformers_greedy, transformers_logits
from tests.engine.greedy_check import near_tie_divergences
from tests.engine.tiny_families import write_llama_cpp_gguf
from tests.engine.tiny_model_dir import write_word_tokenizer

WINDOW = 32
VOCAB = 256
TOLERANCE = 1e-3
MAX_NEW_TOKENS = 12
PROMPTS = [[random.Random(n).randrange(3, VOCAB) for _ in range(length)]
           for n, length in enumerate((70, 97, 130, 66, 115, 81, 40, 122))]


def tiny_multimodal_config():
    import transformers

    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        sliding_window=WINDOW, sliding_window_pattern=6, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                     image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory) -> Path:
    import transformers

    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(tiny_multimodal_config()).to(torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:  # Gemma's norms start at 0: make them matter
                parameter.add_(torch.randn_like(parameter) * 0.3)
    path = tmp_path_factory.mktemp("tiny-gemma3-multimodal")
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def reference(multimodal_dir):
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(multimodal_dir, dtype=torch.float32).eval()


def assert_logits_match(source: ModelSource, reference, lengths=(70, 97, 66), decode_steps: int = 3) -> None:
    config, model = load_model(source, torch.float32, torch.device("cpu"))
    driver = PagedDriver(model, config, TorchAttentionBackend(), num_blocks=64)
    seqs = [PagedSequence(list(PROMPTS[i][:n])) for i, n in enumerate(lengths)]
    ours = driver.step(seqs, [len(s.token_ids) for s in seqs])
    for step in range(decode_steps):
        for seq in seqs:
            seq.token_ids.append((7 * step + len(seq.token_ids)) % VOCAB)
        ours = [torch.cat([o, d]) for o, d in zip(ours, driver.step(seqs, [1] * len(seqs)))]
    for seq, logits in zip(seqs, ours):
        expected = transformers_logits(reference, seq.token_ids)
        diff = (logits - expected[:, :logits.shape[1]]).abs().max().item()
        assert diff <= TOLERANCE, f"{source}: max |logit diff| {diff:.2e} over {len(seq.token_ids)} tokens"


def test_the_checkpoint_is_served_as_its_text_model_with_transformers_logits(multimodal_dir, reference):
    assert json.loads((multimodal_dir / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    with SafetensorsCheckpoint(multimodal_dir) as checkpoint:  # transformers 5 saves the original names
        assert any(n.startswith("language_model.model.") for n in checkpoint.names())
        assert any(n.startswith("vision_tower.") for n in checkpoint.names())
    assert_logits_match(ModelSource("hf", multimodal_dir), reference)


def _newer_name(name: str) -> str:
    """transformers 4.52-4.57's names for Gemma3ForConditionalGeneration."""
    for old, new in RENAMES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def test_newer_weight_names_load_alike_and_the_vision_weights_are_never_read(
        multimodal_dir, reference, tmp_path, monkeypatch):
    newer = tmp_path / "newer-names"
    newer.mkdir()
    for file in multimodal_dir.iterdir():
        if file.suffix != ".safetensors":
            (newer / file.name).write_bytes(file.read_bytes())
    tensors = {_newer_name(n): t for n, t in load_file(multimodal_dir / "model.safetensors").items()}
    assert any(n.startswith("model.vision_tower.") for n in tensors)
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()  # a tied copy
    save_file(tensors, newer / "model.safetensors", metadata={"format": "pt"})
    read: list[str] = []
    original_read = SafetensorsCheckpoint.read

    def recording_read(self, name, *args):
        read.append(name)
        return original_read(self, name, *args)

    monkeypatch.setattr(SafetensorsCheckpoint, "read", recording_read)
    assert_logits_match(ModelSource("hf", newer), reference, lengths=(70,), decode_steps=1)
    assert read and all(n.startswith("model.language_model.") for n in read), sorted(set(read))[:5]


def test_llama_cpp_text_gguf_of_the_checkpoint_loads_as_gemma3(multimodal_dir, reference, tmp_path):
    # llama.cpp's converter reads a multimodal checkpoint's text_config as the model's and drops
    # the language_model prefix and the vision tensors (these go to a separate mmproj file).
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    config = json.loads((multimodal_dir / "config.json").read_text())
    (text_dir / "config.json").write_text(json.dumps({**config["text_config"], "architectures": ["Gemma3ForCausalLM"]}))
    weights = load_file(multimodal_dir / "model.safetensors")
    save_file({n.removeprefix("language_model."): t for n, t in weights.items()
               if n.startswith("language_model.model.")}, text_dir / "model.safetensors")
    gguf_path = write_llama_cpp_gguf(text_dir, tmp_path / "gemma-3-tiny.gguf")
    assert_logits_match(ModelSource("gguf", gguf_path), reference)


@pytest.mark.slow
def test_engine_greedy_tokens_match_transformers_under_chunked_prefill_and_preemption(multimodal_dir, reference):
    expected = transformers_greedy(reference, PROMPTS, MAX_NEW_TOKENS)
    # 5 local one-layer groups and 1 global share 48 blocks: 8 requests of 3-9 blocks preempt;
    # 16-token chunks are half a window.
    llm = LLM(str(multimodal_dir), dtype="float32", enforce_eager=True, num_kv_blocks=48, max_num_batched_tokens=16,
              enable_prefix_caching=False, max_model_len=160)
    specs = [group.spec for group in llm.engine.executor.driver.kv_cache_config.groups]
    assert {type(s) for s in specs} == {SlidingWindowSpec, FullAttentionSpec}
    assert all(s.sliding_window == WINDOW for s in specs if isinstance(s, SlidingWindowSpec))
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    near_ties = near_tie_divergences([o.outputs[0].token_ids for o in outputs], expected)
    assert len(near_ties) <= 1, near_ties
    assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    assert llm.engine.scheduler.kv_cache_manager.stats().blocks_used == 0


# google/gemma-3-4b-it's and google/gemma-3-27b-it's config.json as shipped (transformers 4.50):
# their text_config names only what differs from Gemma3TextConfig's defaults.
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
GEMMA3_27B_IT = {
    **GEMMA3_4B_IT,
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
}


def test_gemma3_4b_shipped_config_parses_to_its_text_model():
    config = model_config_from_hf_dict(GEMMA3_4B_IT, {"bos_token_id": 2, "eos_token_id": [1, 106]})
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (34, 2560, 10240)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (8, 4, 256, 262208)
    assert config.local_window == 1024 and config.sliding_window_pattern == 6
    assert [i for i in range(34) if config.is_global(i)] == [5, 11, 17, 23, 29]
    assert config.rope_theta == 1e6 and dict(config.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
    assert config.local_rope_theta == 10000.0 and config.query_pre_attn_scalar == 256.0
    assert config.max_position_embeddings == 131072 and config.rms_norm_eps == 1e-6 and config.tie_word_embeddings
    assert config.eos_token_ids == (1, 106) and config.bos_token_id == 2 and config.final_logit_softcapping is None
    shape = config.kv_shape()
    assert (shape.sliding_window, shape.num_window_layers, shape.num_global_layers) == (1024, 29, 5)


def test_gemma3_27b_shipped_config_parses_to_its_text_model():
    config = model_config_from_hf_dict(GEMMA3_27B_IT)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (62, 32, 16, 128)
    assert config.query_pre_attn_scalar == 168.0 and config.local_window == 1024
    assert sum(config.is_global(i) for i in range(62)) == 10


def test_kv_size_reads_the_shipped_4b_config_with_the_text_defaults(tmp_path):
    from kvserve.engine.model.model_shape import read_model_shape

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_IT))
    shape = read_model_shape(tmp_path)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (34, 8, 4, 256)
    assert (shape.sliding_window, shape.num_window_layers) == (1024, 29)


def test_the_processor_chat_template_json_is_the_chat_template(multimodal_dir, tmp_path):
    from kvserve.engine.text.tokenizer import Tokenizer

    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_bytes((multimodal_dir / file).read_bytes())
    template = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == template
