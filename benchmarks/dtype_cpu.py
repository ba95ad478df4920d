"""float32 vs bfloat16 for SmolLM2 on this CPU: batched-decode speed and greedy agreement.

    python benchmarks/dtype_cpu.py [--batch 32] [--context 128] [--steps 16] [--threads 2]

Speed: one forward of `batch` decode rows (each with `context` tokens already in the paged
cache) plus logits, median over `steps` steps, after two warm-up steps.
Quality: mean next-token NLL on a fixed English passage (teacher forced), and greedy continuations of `--agree-tokens` tokens for `--agree-prompts` prompts, bf16
against fp32: how many prompts match exactly and the mean share of tokens before the first
divergence. Prints one JSON line per dtype and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvserve.engine.attention_metadata import build_flat_batch
from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import resolve_model
from kvserve.kernels import TorchAttentionBackend

BLOCK_SIZE = 16
PROMPTS = [
    "The capital of France is", "def quicksort(items):", "Once upon a time, in a land far away,",
    "1, 1, 2, 3, 5, 8, 13,", "Q: Why is the sky blue?\nA:", "The quick brown fox jumps over",
    "In 1969, the first humans landed on", "Write a haiku about the sea:\n", "import numpy as np\nx =",
    "The three primary colors are", "My favourite recipe for bread starts with", "Translate to French: cat ->",
    "A paged KV cache splits memory into", "The best way to learn to program is", "SELECT name FROM",
    "Dear hiring manager, I am writing to",
]
PASSAGE = (
    "The history of computing is a story of layers. Early machines were programmed by rewiring panels; "
    "then came stored programs, assemblers and compilers, each hiding the layer below. Operating systems "
    "added virtual memory, which lets every process believe it owns a large contiguous address space while "
    "the hardware maps its pages to scattered physical frames. Decades later the same idea returned in "
    "language model serving, where the keys and values of each request are stored in fixed-size blocks and "
    "a block table translates logical positions into physical memory."
)


class Batch:
    """Requests sharing one paged cache; each new token goes to the next slot of its block table."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, dtype: torch.dtype, num_seqs: int,
                 max_len: int) -> None:
        self.model, self.attention = model, TorchAttentionBackend()
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        shape = (num_seqs * blocks_per_seq, config.num_kv_heads, BLOCK_SIZE, config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(config.num_layers)]
        # Interleave requests' blocks (block b of request r is b * num_seqs + r): non-contiguous.
        self.block_ids = [[b * num_seqs + r for b in range(blocks_per_seq)] for r in range(num_seqs)]
        self.lens = [0] * num_seqs

    @torch.inference_mode()
    def step(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """Append new_tokens[i] to request i; returns the last row's logits per request."""
        q_lens = [len(t) for t in new_tokens]
        seq_lens = [n + q for n, q in zip(self.lens, q_lens)]
        flat = build_flat_batch(q_lens, self.lens, [self.block_ids], BLOCK_SIZE)
        ids = torch.tensor([t for toks in new_tokens for t in toks])
        hidden = self.model(ids, flat.positions, self.kv_caches, flat.layer_metadata([0] * len(self.kv_caches)), self.attention)
        last_rows = torch.tensor(seq_lens) - torch.tensor(self.lens)
        self.lens = seq_lens
        return self.model.compute_logits(hidden[torch.cumsum(last_rows, 0) - 1])


def decode_speed(model, config, dtype, batch: int, context: int, steps: int) -> dict:
    runner = Batch(model, config, dtype, batch, context + steps + 4)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, config.vocab_size, (batch, context), generator=generator).tolist()
    logits = runner.step(prompts)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        logits = runner.step([[t] for t in logits.argmax(-1).tolist()])
        if i >= 2:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"step_ms": round(step_s * 1e3, 1), "tokens_per_s": round(batch / step_s, 1)}


def greedy(model, config, dtype, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    runner = Batch(model, config, dtype, len(prompts), max(map(len, prompts)) + max_new)
    logits = runner.step(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new):
        tokens = logits.argmax(-1).tolist()
        for out, token in zip(outputs, tokens):
            out.append(token)
        logits = runner.step([[t] for t in tokens])
    return outputs


@torch.inference_mode()
def mean_nll(model, config, dtype, ids: list[int]) -> float:
    """Teacher-forced next-token negative log-likelihood (nats/token) of one passage."""
    runner = Batch(model, config, dtype, 1, len(ids))
    flat = build_flat_batch([len(ids)], [0], [runner.block_ids], BLOCK_SIZE)
    hidden = model(torch.tensor(ids), flat.positions, runner.kv_caches, flat.layer_metadata([0] * len(runner.kv_caches)), runner.attention)
    logits = model.compute_logits(hidden)
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--agree-prompts", type=int, default=16)
    parser.add_argument("--agree-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer  # bench extra; only to tokenize the agreement prompts

    source = resolve_model("SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    prompts = [tokenizer.encode(p) for p in (PROMPTS * 4)[: args.agree_prompts]]
    results, continuations = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        config, model = load_model(source, dtype, torch.device("cpu"))
        results[str(dtype)] = decode_speed(model, config, dtype, args.batch, args.context, args.steps)
        continuations[dtype] = greedy(model, config, dtype, prompts, args.agree_tokens)
        results[str(dtype)]["passage_nll"] = round(mean_nll(model, config, dtype, tokenizer.encode(PASSAGE)), 4)
        print(json.dumps({"dtype": str(dtype), "batch": args.batch, "context": args.context, "threads": args.threads,
                          **results[str(dtype)]}), flush=True)
    prefix_share, exact = [], 0
    for ref, bf in zip(continuations[torch.float32], continuations[torch.bfloat16]):
        same = next((i for i, (a, b) in enumerate(zip(ref, bf)) if a != b), len(ref))
        prefix_share.append(same / len(ref))
        exact += same == len(ref)
    fp32, bf16 = results["torch.float32"], results["torch.bfloat16"]
    print(json.dumps({
        "faster": "bfloat16" if bf16["tokens_per_s"] > fp32["tokens_per_s"] else "float32",
        "bf16_speedup": round(bf16["tokens_per_s"] / fp32["tokens_per_s"], 2),
        "greedy_exact_match": f"{exact}/{len(prompts)}",
        "greedy_mean_agreeing_prefix": round(statistics.mean(prefix_share), 3),
        "load_average": round(os.getloadavg()[0], 1),
    }))


if __name__ == "__main__":
    main()
