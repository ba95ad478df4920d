"""Fixtures for the model tests: the default SmolLM2 GGUF (ours and transformers', each loaded
once per session), tiny random Llama/Qwen2/Mistral checkpoints saved as safetensors, and a small
paged-cache driver that feeds our forward through shuffled, non-contiguous block tables."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvserve.engine.attention_metadata import build_flat_batch
from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource, resolve_model
from kvserve.kernels import TorchAttentionBackend

BLOCK_SIZE = 16
# Tiny checkpoints share SmolLM2's tokenizer, so their vocabulary matches it.
TINY_VOCAB = 49152


@pytest.fixture(scope="session")
def attention_backend() -> TorchAttentionBackend:
    return TorchAttentionBackend()


@dataclass
class PagedSequence:
    token_ids: list[int]
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)


class PagedDriver:
    """Runs our model over several sequences at once through a paged KV cache whose physical
    blocks are handed out in shuffled order, so every block table is non-contiguous and the
    requests' blocks interleave."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, attention, num_blocks: int, seed: int = 0) -> None:
        self.model, self.config, self.attention = model, config, attention
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, config.num_kv_heads, BLOCK_SIZE, config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(config.num_layers)]
        # Window layers (Gemma 3's local ones) attend within their window, as their spec says.
        self.layer_windows = [getattr(spec, "sliding_window", 0) for spec in model.kv_cache_specs("float32", 4)]
        self.windows = sorted(set(self.layer_windows))
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)

    def step(self, seqs: list[PagedSequence], num_new: list[int]) -> list[torch.Tensor]:
        """Compute the next num_new[i] tokens of each sequence in one flattened forward;
        returns each sequence's float32 logits for those tokens ([num_new[i], vocab])."""
        ids = []
        for seq, n in zip(seqs, num_new, strict=True):
            end = seq.num_computed + n
            while len(seq.block_ids) * BLOCK_SIZE < end:
                seq.block_ids.append(self.free_blocks.pop())
            ids += seq.token_ids[seq.num_computed:end]
        # One metadata per distinct window (0: full attention); every layer keeps all its blocks.
        flat = build_flat_batch(num_new, [s.num_computed for s in seqs], [[s.block_ids for s in seqs]] * len(self.windows),
                                BLOCK_SIZE, group_windows=self.windows)
        with torch.inference_mode():
            metadata = flat.layer_metadata([self.windows.index(w) for w in self.layer_windows])
            hidden = self.model(torch.tensor(ids), flat.positions, self.kv_caches, metadata, self.attention)
            logits = self.model.compute_logits(hidden)
        for seq, n in zip(seqs, num_new):
            seq.num_computed += n
        return list(logits.split(num_new))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one batch, then decode all of them together token by token."""
        seqs = [PagedSequence(list(p)) for p in prompts]
        logits = self.step(seqs, [len(p) for p in prompts])
        outputs: list[list[int]] = [[] for _ in prompts]
        for _ in range(max_new_tokens):
            for seq, out, row in zip(seqs, outputs, logits):
                token = int(row[-1].argmax())
                out.append(token)
                seq.token_ids.append(token)
            if len(outputs[0]) == max_new_tokens:
                break
            logits = self.step(seqs, [1] * len(seqs))
        return outputs


@dataclass(frozen=True)
class ReferenceGreedy:
    token_ids: list[int]
    top2_gaps: list[float]  # transformers' top-1 minus top-2 logit at each generated step


def transformers_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[ReferenceGreedy]:
    """Plain greedy with transformers' own KV cache for a left-padded batch of prompts: no
    stopping at EOS, no logits processors. Batched so the reference costs max_new_tokens
    forwards, not one per token per prompt. Runs on the model's device (benchmarks/gpu_parity.py
    uses it on CUDA)."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens: list[list[int]] = [[] for _ in prompts]
    gaps: list[list[float]] = [[] for _ in prompts]
    past = None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
            past = out.past_key_values
            top2 = out.logits[:, -1].float().topk(2)
            values, indices = top2.values.cpu(), top2.indices.cpu()
            for i in range(len(prompts)):
                tokens[i].append(int(indices[i, 0]))
                gaps[i].append(float(values[i, 0] - values[i, 1]))
            ids = top2.indices[:, :1]
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
    return [ReferenceGreedy(t, g) for t, g in zip(tokens, gaps)]


def transformers_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([prompt])).logits[0].float()


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_source: ModelSource):
    """transformers' LlamaForCausalLM from the same GGUF, float32: the reference. Loaded once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_source.path.parent), gguf_file=smollm2_source.path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_source: ModelSource):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_source.path.parent), gguf_file=smollm2_source.path.name)


@pytest.fixture(scope="session")
def our_smollm2(smollm2_source: ModelSource) -> tuple[ModelConfig, LlamaForCausalLM]:
    return load_model(smollm2_source, torch.float32, torch.device("cpu"))


def _tiny_hf_config(architecture: str):
    """Small enough to build in a second, with GQA, and the family's distinctive features."""
    import transformers

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.2)  # larger than default so that a wrong rope or bias moves logits visibly
    if architecture == "llama":
        # llama3 scaling with a short original context so that every frequency band is exercised.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if architecture == "llama-tied-linear":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        return transformers.LlamaConfig(**{**common, "tie_word_embeddings": True}, rope_parameters=rope)
    if architecture == "llama-dynamic":
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
        return transformers.LlamaConfig(**{**common, "max_position_embeddings": 32}, rope_parameters=rope)
    if architecture == "qwen2":
        return transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if architecture == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(architecture)


TINY_ARCHITECTURES = ("llama", "llama-tied-linear", "qwen2", "mistral")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, hf_smollm2_tokenizer) -> dict[str, Path]:
    """Random tiny checkpoints saved like a real HF model directory (config.json, safetensors,
    tokenizer.json, tokenizer_config.json with SmolLM2's chat template)."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for i, architecture in enumerate(TINY_ARCHITECTURES + ("llama-dynamic",)):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(_tiny_hf_config(architecture), dtype=torch.float32)
        if architecture == "qwen2":  # transformers initialises biases to zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
        path = tmp_path_factory.mktemp(f"tiny-{architecture}")
        model.save_pretrained(path)
        hf_smollm2_tokenizer.save_pretrained(path)
        dirs[architecture] = path
    return dirs
