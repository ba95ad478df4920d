"""The accuracy cost of an fp8 (e4m3) KV cache on the default model.

    python benchmarks/fp8_kv_accuracy.py [--dtype float32] [--max-tokens 64]

Greedy continuations of the same prompts with the KV cache in the model's dtype and in fp8;
prints how many continuations are identical, the mean length of the agreeing prefix, and the
mean absolute difference of the chosen tokens' logprobs over that prefix.
"""

from __future__ import annotations

import argparse

from kvserve.engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Write a short poem about autumn:\n",
    "In computer science, a hash table is",
    "The recipe for pancakes needs",
    "Q: Why is the sky blue?\nA:",
    "import torch\n\nclass Model(torch.nn.Module):",
    "The history of the Roman Empire began",
    "To install a Python package, run",
    "A paged KV cache stores keys and values in",
    "The best way to learn a new language is",
    "SELECT name, COUNT(*) FROM users",
    "Photosynthesis converts sunlight into",
    "My favourite book is",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(dtype=args.dtype, kv_cache_dtype=kv)
        runs[kv] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm

    identical, prefix_lens, logprob_diffs = 0, [], []
    for base, fp8 in zip(runs["auto"], runs["fp8"]):
        n = next((i for i, (a, b) in enumerate(zip(base.token_ids, fp8.token_ids)) if a != b), len(base.token_ids))
        identical += n == len(base.token_ids)
        prefix_lens.append(n)
        logprob_diffs += [abs(a.logprob - b.logprob) for a, b in zip(base.logprobs[:n], fp8.logprobs[:n])]
    total = len(PROMPTS) * args.max_tokens
    print(f"model dtype {args.dtype}; {len(PROMPTS)} prompts x {args.max_tokens} greedy tokens")
    print("| KV cache | identical continuations | tokens before first divergence | mean |logprob diff| |")
    print("|---|---|---|---|")
    print(f"| fp8 e4m3 vs {args.dtype} | {identical}/{len(PROMPTS)} | {sum(prefix_lens)}/{total} "
          f"({100 * sum(prefix_lens) / total:.1f}%) | {sum(logprob_diffs) / max(len(logprob_diffs), 1):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
