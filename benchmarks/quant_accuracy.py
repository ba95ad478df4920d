"""What --quantization int8 / int4 costs in accuracy, and what it buys in single-stream speed.

    python benchmarks/quant_accuracy.py [--max-tokens 64] [--repeats 10] [--skip-accuracy] [--out quantization.json]

Accuracy, for bf16 (the reference), int8, int4, and two int4 variants not chosen (an int4
lm_head; groups of 64): greedy continuations of 16 fixed prompts x --max-tokens tokens through the
engine (LLM), compared with bf16's (identical continuations; share of tokens before the first
divergence), and over a fixed English passage (teacher forced) the mean next-token NLL, the mean
KL divergence of the next-token distribution from bf16's, and how often its argmax is bf16's: the
last two do not hinge on the first near-tie as greedy continuations do. Deterministic.
Speed, interleaved in one process (A, B, C, A, B, C, ...; minimum of --repeats):
- weight pass: one row through every weight matrix of the model (each its own tensor), as bf16
  `nn.Linear` (torch's single-stream floor) and as the int8 / int4 layers --quantization installs;
- single stream: time per output token of one greedy stream through the whole engine (LLM), per
  mode, against the bf16 weight pass (the issue's target: int4 <= 0.5x, int8 <= 0.8x).
Speed figures are as noisy as the machine is busy; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dtype_cpu import BLOCK_SIZE, PASSAGE, Batch  # noqa: E402
from fp8_kv_accuracy import PROMPTS  # noqa: E402
from model_shapes import ALL_SHAPES, LM_HEAD  # noqa: E402

from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine.worker import model_preparation  # noqa: E402
from kvserve.engine.attention_metadata import build_flat_batch  # noqa: E402
from kvserve.engine.compilation import symbolic_sizes  # noqa: E402
from kvserve.engine.quantization import Int4Linear, Int8Linear, quantize_model  # noqa: E402
from kvserve.engine.quantization.int4_linear import GROUP_SIZE  # noqa: E402
from kvserve.engine.quantization.quantize_model import OUTPUT_LAYER_MODE  # noqa: E402

@dataclass(frozen=True)
class Variant:
    label: str
    mode: str | None  # --quantization
    output_layer_mode: str | None = None  # None: the engine's choice (OUTPUT_LAYER_MODE)
    int4_group_size: int = GROUP_SIZE
    kernel: str = "auto"  # quantize_model's


VARIANTS = [Variant("bf16", None), Variant("int8", "int8"), Variant("int4", "int4"),
            Variant("int4 on torch's int4/int8 ops (before the VNNI kernels)", "int4", kernel="torch"),
            Variant("int4 with an int4 lm_head (not chosen)", "int4", output_layer_mode="int4"),
            Variant("int4 in groups of 64 (not chosen)", "int4", int4_group_size=64)]
SPEED_MODES = ("bf16", "int8", "int4")
CONVERTERS = {"int8": Int8Linear.from_linear, "int4": Int4Linear.from_linear}


@dataclass(frozen=True)
class AccuracyRow:
    label: str
    identical: int  # greedy continuations identical to bf16's
    agreeing_tokens: int  # tokens before the first divergence, summed over prompts
    passage_nll: float  # nats/token
    passage_kl: float  # mean KL(bf16 || this) of the next-token distribution, nats/token
    passage_top1: float  # share of passage positions whose argmax is bf16's


@contextmanager
def built_as(variant: Variant) -> Iterator[None]:
    """While an LLM is built, its quantization step uses the variant's settings (the engine's own
    path: converted before the weights are prepacked and the layers compiled)."""
    convert = functools.partial(quantize_model, output_layer_mode=variant.output_layer_mode,
                                int4_group_size=variant.int4_group_size, kernel=variant.kernel)
    with mock.patch.object(model_preparation, "quantize_model", convert):
        yield


def passage_logits(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits at every position of PASSAGE (teacher forced, through the engine's model) and
    the next token at each."""
    model, config = llm.engine.executor.driver.runner.model, llm.engine.model_config
    ids = llm.get_tokenizer().encode(PASSAGE)
    # As the engine calls its compiled layers (inference mode, symbolic sizes): otherwise each
    # variant adds graphs until dynamo's recompile limit and the later engines run eagerly.
    with torch.inference_mode(), symbolic_sizes():
        runner = Batch(model, config, torch.bfloat16, 1, len(ids))
        flat = build_flat_batch([len(ids)], [0], [runner.block_ids], BLOCK_SIZE)
        hidden = model(torch.tensor(ids), flat.positions, runner.kv_caches, flat.layer_metadata([0] * len(runner.kv_caches)), runner.attention)
        return model.compute_logits(hidden).float(), torch.tensor(ids[1:])


def accuracy(max_tokens: int) -> list[AccuracyRow]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows, reference, reference_logits = [], None, None
    for variant in VARIANTS:
        with built_as(variant):
            llm = LLM(dtype="bfloat16", quantization=variant.mode, enable_prefix_caching=False,
                      num_kv_blocks=256, max_model_len=1024)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        logits, targets = passage_logits(llm)
        reference, reference_logits = reference or tokens, reference_logits if reference_logits is not None else logits
        prefix = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r)) for r, t in zip(reference, tokens)]
        log_p, log_q = reference_logits.log_softmax(-1), logits.log_softmax(-1)
        rows.append(AccuracyRow(
            variant.label, sum(p == len(r) for p, r in zip(prefix, reference)), sum(prefix),
            torch.nn.functional.cross_entropy(logits[:-1], targets).item(),
            (log_p.exp() * (log_p - log_q)).sum(-1).mean().item(),
            (logits.argmax(-1) == reference_logits.argmax(-1)).float().mean().item()))
        print(f"{rows[-1]}", flush=True)
        del llm
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
    parser.add_argument("--skip-accuracy", action="store_true", help="speed only (loads the model 3 times, not 8)")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    rows = [] if args.skip_accuracy else accuracy(args.max_tokens)
    passes = interleaved_min(weight_pass_fns(), args.repeats)
    tpot = single_stream_tpot(args.repeats)
    floor = passes["bf16"]
    total = len(PROMPTS) * args.max_tokens
    if rows:
        print(f"\n{len(PROMPTS)} prompts x {args.max_tokens} greedy tokens, bf16 activations, {torch.get_num_threads()} threads")
        print("| weights | identical greedy continuations vs bf16 | tokens before first divergence | passage NLL "
              "| passage KL from bf16 | passage argmax = bf16's |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r.label} | {r.identical}/{len(PROMPTS)} | {r.agreeing_tokens}/{total} "
                  f"({100 * r.agreeing_tokens / total:.1f}%) | {r.passage_nll:.4f} | {r.passage_kl:.4f} "
                  f"| {100 * r.passage_top1:.1f}% |")
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
            "accuracy": [{"weights": r.label, "identical": r.identical, "agreeing_tokens": r.agreeing_tokens,
                          "total_tokens": total, "passage_nll": r.passage_nll, "passage_kl": r.passage_kl,
                          "passage_top1": r.passage_top1} for r in rows],
            "speed": {mode: {"weight_pass_ms": passes[mode] * 1e3, "tpot_ms": tpot[mode] * 1e3} for mode in SPEED_MODES},
            "bf16_floor_ms": floor * 1e3}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
