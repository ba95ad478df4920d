"""The accuracy cost of a quantised KV cache on the default model: fp8 (e4m3, per-tensor scales)
and int8 (a scale per token and KV head), side by side.

    python benchmarks/fp8_kv_accuracy.py [--dtype float32] [--max-tokens 64] [--prompts 16] [--kv-dtypes fp8,int8] [--enforce-eager]

Greedy continuations of the same prompts with the KV cache in the model's dtype and in each
quantised dtype; prints, per dtype, how many continuations are identical, the share of tokens
before the first divergence, and the mean absolute difference of the chosen tokens' logprobs
over that prefix.
"""

from __future__ import annotations

import argparse

from kvserve.engine import LLM, SamplingParams

LABELS = {"fp8": "fp8 e4m3 (per-tensor scale)", "int8": "int8 (scale per token and head)"}

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
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--kv-dtypes", default="fp8,int8", help="comma-separated, of fp8, int8")
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (quicker starts, same figures)")
    args = parser.parse_args()
    kv_dtypes = [name for name in args.kv_dtypes.split(",") if name]
    if not kv_dtypes or any(name not in LABELS for name in kv_dtypes):
        parser.error(f"--kv-dtypes takes {', '.join(LABELS)}, got {args.kv_dtypes!r}")
    prompts = PROMPTS[: max(1, args.prompts)]

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    runs = {}
    for kv in ("auto", *kv_dtypes):
        llm = LLM(dtype=args.dtype, kv_cache_dtype=kv, enforce_eager=args.enforce_eager)
        runs[kv] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm

    total = len(prompts) * args.max_tokens
    print(f"model dtype {args.dtype}; {len(prompts)} prompts x {args.max_tokens} greedy tokens")
    print("| KV cache | identical continuations | tokens before first divergence | mean |logprob diff| |")
    print("|---|---|---|---|")
    for kv in kv_dtypes:
        identical, prefix_lens, logprob_diffs = 0, [], []
        for base, quantised in zip(runs["auto"], runs[kv]):
            n = next((i for i, (a, b) in enumerate(zip(base.token_ids, quantised.token_ids)) if a != b), len(base.token_ids))
            identical += n == len(base.token_ids)
            prefix_lens.append(n)
            logprob_diffs += [abs(a.logprob - b.logprob) for a, b in zip(base.logprobs[:n], quantised.logprobs[:n])]
        print(f"| {LABELS[kv]} vs {args.dtype} | {identical}/{len(prompts)} | {sum(prefix_lens)}/{total} "
              f"({100 * sum(prefix_lens) / total:.1f}%) | {sum(logprob_diffs) / max(len(logprob_diffs), 1):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
