"""A tiny random Llama checkpoint written like a Hugging Face model folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML template).

It loads in well under a second and needs neither transformers nor the real model, so tests can
run the *real* engine (scheduler, KV cache, sampler, detokenizer) behind the real app: what the
gauges, the soak and the fault tests need. The tokenizer is byte-level BPE without merges: every
byte is a token, so any text round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def write_tiny_checkpoint(path: Path, *, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                          kv_heads: int = 2, context: int = 512, seed: int = 0) -> Path:
    """Writes the folder and returns it; `kvserve serve --model PATH` serves it."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _byte_level_tokenizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.save(str(path / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN, "chat_template": CHATML}))
    ffn = hidden * 2
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": context,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "eos_token_id": eos_id,
    }))
    generator = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    weights = {"model.embed_tokens.weight": random(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(num_layers):
        layer = f"model.layers.{i}."
        weights.update({
            layer + "input_layernorm.weight": torch.ones(hidden),
            layer + "post_attention_layernorm.weight": torch.ones(hidden),
            layer + "self_attn.q_proj.weight": random(heads * head_dim, hidden),
            layer + "self_attn.k_proj.weight": random(kv_heads * head_dim, hidden),
            layer + "self_attn.v_proj.weight": random(kv_heads * head_dim, hidden),
            layer + "self_attn.o_proj.weight": random(hidden, heads * head_dim),
            layer + "mlp.gate_proj.weight": random(ffn, hidden),
            layer + "mlp.up_proj.weight": random(ffn, hidden),
            layer + "mlp.down_proj.weight": random(hidden, ffn),
        })
    save_file(weights, str(path / "model.safetensors"))
    return path
