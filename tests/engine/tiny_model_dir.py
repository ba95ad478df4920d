"""A complete tiny HF model directory (config.json, safetensors, tokenizer.json,
tokenizer_config.json) that both kvserve and transformers load in well under a second.

The tokenizer is a word-level one over 128 made-up words ("w0".."w127", with "w2" the EOS), so
prompts are plain space-separated words and every token decodes to a known string.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, decoders

from tests.engine.test_model_gguf import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, hf_weights
from tests.engine.test_model_hf import write_dir

TOKENIZER_EOS = 2


def tiny_config(**overrides: object) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 256, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": TOKENIZER_EOS, "rope_theta": 10000.0, "hidden_act": "silu",
              "torch_dtype": "float32"}
    return config | overrides


def write_tiny_model(path: Path, *, generation_config: dict | None = None, seed: int = 0,
                     **config_overrides: object) -> Path:
    weights = hf_weights(seed=seed)
    import numpy as np

    weights["lm_head.weight"] = np.random.default_rng(seed + 100).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    write_dir(path, weights, tiny_config(**config_overrides))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    write_word_tokenizer(path)
    return path


def write_word_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """tokenizer.json / tokenizer_config.json of words "w0".."w{vocab_size - 1}" ("w2" the EOS)."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{TOKENIZER_EOS}", "bos_token": "w1"}))
