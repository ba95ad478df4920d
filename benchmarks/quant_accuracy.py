"""What --quantization int8 / int4 costs in accuracy, and what it buys in single-stream speed.

    python benchmarks/quant_accuracy.py [--max-tokens 64] [--repeats 10] [--out quantization.json]

Accuracy, for bf16 (the reference), int8, int4, and int4 with an int4 lm_head (the variant not
chosen): greedy continuations of 16 fixed prompts x --max-tokens tokens through the engine (LLM),
compared with bf16's (identical continuations; share of tokens before the first divergence), and
the mean next-token NLL of a fixed English passage (teacher forced). Deterministic.
Speed, interleaved in one process (A, B, C, A, B, C, ...; minimum of --repeats):
- weight pass: one row through every weight matrix of the model (each its own tensor), as bf16
  `nn.Linear` (torch's single-stream floor) and as the int8 / int4 layers --quantization installs;
- single stream: time per output token of one greedy stream through the whole engine (LLM), per
  mode, against the bf16 weight pass (the issue's target: int4 <= 0.5x, int8 <= 0.8x).
Speed figures are as noisy as the machine is busy; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dtype_cpu import PASSAGE, mean_nll  # noqa: E402
from fp8_kv_accuracy import PROMPTS  # noqa: E402
from model_shapes import ALL_SHAPES, LM_HEAD  # noqa: E402

from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine.quantization import Int4Linear, Int8Linear, quantize_model  # noqa: E402
from kvserve.engine.quantization.quantize_model import OUTPUT_LAYER_MODE  # noqa: E402

# (label, --quantization, lm_head override)
MODES = [("bf16", None, None), ("int8", "int8", None), ("int4", "int4", None),
         ("int4, lm_head int4 too (not chosen)", "int4", "int4")]
SPEED_MODES = ("bf16", "int8", "int4")
CONVERTERS = {"int8": Int8Linear.from_linear, "int4": Int4Linear.from_linear}


def accuracy(max_tokens: int) -> list[tuple[str, int, int, float]]:
    """(label, identical continuations, tokens before first divergence, passage NLL) per mode."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows, reference = [], None
    for label, mode, head in MODES:
        llm = LLM(dtype="bfloat16", quantization=None if head else mode, enable_prefix_caching=False,
                  num_kv_blocks=256, max_model_len=1024)
        model = llm.engine.model_runner.model
        if head:  # the variant: quantized by hand with the output layer at 4 bits as well
            quantize_model(model, mode, output_layer_mode=head)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        nll = mean_nll(model, llm.engine.model_config, torch.bfloat16, llm.get_tokenizer().encode(PASSAGE))
        reference = reference or tokens
        prefix = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r)) for r, t in zip(reference, tokens)]
        rows.append((label, sum(p == len(r) for p, r in zip(prefix, reference)), sum(prefix), nll))
        print(f"{label}: NLL {nll:.4f}", flush=True)
        del llm, model
    return rows


def interleaved_min(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    with torch.inference_mode():
        for _ in range(repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def weight_pass_fns() -> dict[str, Callable[[], object]]:
    """One row through every matrix of the model's shapes, per mode, each matrix its own tensor; the
    output layer converted as quantize_model converts it."""
    torch.manual_seed(0)
    layers = []
    for shape in ALL_SHAPES:
        for _ in range(shape.per_forward):
            linear = nn.Linear(shape.in_features, shape.out_features, bias=False)
            nn.init.normal_(linear.weight, std=0.02)
            layers.append((shape.name, linear.to(torch.bfloat16)))
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in {s.in_features for s in ALL_SHAPES}}
    fns = {}
    for mode in SPEED_MODES:
        modules = [linear if mode == "bf16" else
                   CONVERTERS[OUTPUT_LAYER_MODE[mode] if name == LM_HEAD.name else mode](linear)
                   for name, linear in layers]
        fns[mode] = lambda modules=modules: [m(xs[m.in_features]) for m in modules]
    return fns


def single_stream_tpot(repeats: int, decode_tokens: int = 32) -> dict[str, float]:
    """Seconds per output token of one greedy stream through the whole engine, per mode: the
    difference between a (decode_tokens + 1)-token and a 1-token generation of the same prompt,
    each the minimum over interleaved runs, divided by decode_tokens."""
    prompt = list(range(100, 164))
    llms = {mode: LLM(dtype="bfloat16", quantization=None if mode == "bf16" else mode, enable_prefix_caching=False,
                      num_kv_blocks=64, max_model_len=512) for mode in SPEED_MODES}
    fns = {}
    for mode, llm in llms.items():
        for tokens in (1, decode_tokens + 1):
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            fns[(mode, tokens)] = lambda llm=llm, params=params: llm.generate([prompt], params, use_tqdm=False)
    best = interleaved_min(fns, repeats)
    return {mode: (best[(mode, decode_tokens + 1)] - best[(mode, 1)]) / decode_tokens for mode in SPEED_MODES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    rows = accuracy(args.max_tokens)
    passes = interleaved_min(weight_pass_fns(), args.repeats)
    tpot = single_stream_tpot(args.repeats)
    floor = passes["bf16"]
    total = len(PROMPTS) * args.max_tokens
    print(f"\n{len(PROMPTS)} prompts x {args.max_tokens} greedy tokens, bf16 activations, {torch.get_num_threads()} threads")
    print("| weights | identical greedy continuations vs bf16 | tokens before first divergence | passage NLL |")
    print("|---|---|---|---|")
    for label, same, prefix, nll in rows:
        print(f"| {label} | {same}/{len(PROMPTS)} | {prefix}/{total} ({100 * prefix / total:.1f}%) | {nll:.4f} |")
    print(f"\nspeed (noisy; min of {args.repeats} interleaved runs): ms, and x the bf16 weight pass (torch's floor)")
    print("| weights | weight pass, 1 row | single-stream decode, per output token (engine) |")
    print("|---|---|---|")
    for mode in SPEED_MODES:
        print(f"| {mode} | {passes[mode] * 1e3:.1f} ({passes[mode] / floor:.2f}x) "
              f"| {tpot[mode] * 1e3:.1f} ({tpot[mode] / floor:.2f}x) |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "threads": torch.get_num_threads(), "prompts": len(PROMPTS), "max_tokens": args.max_tokens,
            "accuracy": [{"weights": label, "identical": same, "agreeing_tokens": prefix, "total_tokens": total,
                          "passage_nll": nll} for label, same, prefix, nll in rows],
            "speed": {mode: {"weight_pass_ms": passes[mode] * 1e3, "tpot_ms": tpot[mode] * 1e3} for mode in SPEED_MODES},
            "bf16_floor_ms": floor * 1e3}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
