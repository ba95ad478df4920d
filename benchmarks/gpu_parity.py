"""Greedy parity of the whole engine with transformers on one device (benchmarks/gpu_checks.sh runs
it on CUDA): kvserve's `LLM.generate` (scheduler, paged cache, the device's attention kernels) and
transformers' own greedy loop on the same GGUF, in float32, 8 prompts x 64 tokens decoded together.

    python benchmarks/gpu_parity.py --device cuda --out parity.json [--model PATH.gguf]

Batched float32 math may differ in the last bits, so a continuation may part ways where
transformers' top two logits are within --near-tie: such a divergence is counted, any other fails
(exit code 1). Also prints bf16 agreement (tokens before the first divergence), which is figures
only: bf16 continuations drift apart honestly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.model.model_source import resolve_model

# The tests' reference loop (transformers' own KV cache, a left-padded batch): run from the
# repository root, as gpu_checks.sh does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.engine.conftest import transformers_greedy  # noqa: E402

PROMPTS = [
    "The capital of France is", "def quicksort(items):", "Once upon a time, in a land far away, there lived a",
    "1, 1, 2, 3, 5, 8, 13,", "Q: Why is the sky blue?\nA:", "The quick brown fox jumps over the lazy dog. The quick",
    "In 1969, the first humans landed on", "Write a haiku about the sea:\n",
]


@dataclass(frozen=True)
class Comparison:
    dtype: str
    prompts: int
    tokens_per_prompt: int
    identical: int  # continuations equal token for token
    agreeing_tokens: int  # tokens before each continuation's first divergence, summed
    near_tie_divergences: int  # divergences where transformers' top-2 gap < near_tie
    other_divergences: list[str]  # "prompt i token j: gap g" for each divergence that is not a near tie
    seconds_kvserve: float
    seconds_transformers: float


def compare(dtype: str, device: torch.device, model_name: str, steps: int, near_tie: float) -> Comparison:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(model_name)
    tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    # Eager: CUDA runs eagerly anyway, and a CPU check of this script should not wait for compiles.
    llm = LLM(model=model_name, device=str(device), dtype=dtype, max_model_len=1024, num_kv_blocks=256,
              enable_prefix_caching=False, enforce_eager=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    seconds_kvserve = time.perf_counter() - start
    ours = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                 dtype=getattr(torch, dtype)).to(device).eval()
    start = time.perf_counter()
    references = transformers_greedy(model, prompts, steps)
    reference, gaps = [r.token_ids for r in references], [r.top2_gaps for r in references]
    seconds_transformers = time.perf_counter() - start
    identical = agreeing = near = 0
    others = []
    for n, (a, b) in enumerate(zip(ours, reference)):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None and len(a) == len(b):
            identical += 1
            agreeing += len(b)
            continue
        i = min(len(a), len(b)) if i is None else i
        agreeing += i
        if i < len(gaps[n]) and gaps[n][i] < near_tie:
            near += 1
        else:
            others.append(f"prompt {n} token {i}: gap {gaps[n][i] if i < len(gaps[n]) else float('nan'):.2e}")
    return Comparison(dtype, len(prompts), steps, identical, agreeing, near, others, seconds_kvserve,
                      seconds_transformers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a GGUF file or the bundled model's name")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--near-tie", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = []
    for dtype in ("float32", "bfloat16"):
        result = compare(dtype, device, args.model, args.steps, args.near_tie)
        results.append(result)
        total = result.prompts * result.tokens_per_prompt
        print(f"{dtype} on {device}: {result.identical}/{result.prompts} continuations identical, "
              f"{100 * result.agreeing_tokens / total:.1f}% of tokens before the first divergence, "
              f"{result.near_tie_divergences} near-tie divergences, {len(result.other_divergences)} others "
              f"(kvserve {result.seconds_kvserve:.1f} s, transformers {result.seconds_transformers:.1f} s)", flush=True)
    args.out.write_text(json.dumps({"device": str(device), "torch": torch.__version__,
                                    "name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                    "results": [asdict(r) for r in results]}, indent=2) + "\n")
    # float32 is the exactness check; bf16 is reported only.
    fp32 = results[0]
    if fp32.other_divergences:
        print(f"FAIL: float32 divergences that are not near ties: {fp32.other_divergences}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
