"""Decode-step time, eager vs compiled forward (issue 12), interleaved in one process.

    python benchmarks/compiled_forward.py [--rows 1 16 64 256] [--context 256] [--dtype bfloat16]

Two runners over two copies of the model, one compiled (engine/compilation.py); each step is a
full ModelRunner.execute of `rows` single-token decodes at `context` tokens of context (metadata,
forward, logits, greedy sampling). Eager and compiled alternate step by step, so machine noise
hits both alike; the table shows the minimum and median per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import resolve_model
from kvserve.engine.model_runner import KVCacheSpec, ModelRunner
from kvserve.kernels import select_attention_backend
from kvserve.scheduler.output import ScheduledRequest, SchedulerOutput
from kvserve.scheduler.sampling_params import SamplingParams

BLOCK_SIZE = 16


def make_runner(model_name: str, dtype: torch.dtype, num_blocks: int, compiled: bool) -> ModelRunner:
    config, model = load_model(resolve_model(model_name), dtype, torch.device("cpu"))
    runner = ModelRunner(model, config, KVCacheSpec(num_blocks, BLOCK_SIZE, dtype),
                         select_attention_backend("torch", torch.device("cpu")),
                         torch.device("cpu"), eos_token_ids=(), compiled=compiled)
    runner.warm_up()
    return runner


def decode_step(rows: int, context: int) -> SchedulerOutput:
    """`rows` requests, each decoding its token at position `context` through its own blocks."""
    blocks = context // BLOCK_SIZE + 1
    greedy = SamplingParams(temperature=0.0)
    return SchedulerOutput([
        ScheduledRequest(request_id=str(i), token_ids=[100 + i], num_computed_tokens=context,
                         block_ids=list(range(i * blocks, (i + 1) * blocks)), samples=True, sampling_params=greedy,
                         seed=0, prompt_token_ids=[1] * context, output_token_ids=[])
        for i in range(rows)
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    num_blocks = max(args.rows) * (args.context // BLOCK_SIZE + 1)
    start = time.perf_counter()
    runners = {"eager": make_runner(args.model, dtype, num_blocks, compiled=False)}
    runners["compiled"] = make_runner(args.model, dtype, num_blocks, compiled=True)
    print(f"set-up incl. compile: {time.perf_counter() - start:.1f} s; torch threads: {torch.get_num_threads()}")
    print(f"{'rows':>5} {'eager min':>10} {'eager med':>10} {'comp min':>10} {'comp med':>10} {'speed-up':>9}  (ms per step)")
    for rows in args.rows:
        step = decode_step(rows, args.context)
        times: dict[str, list[float]] = {name: [] for name in runners}
        for i in range(args.steps + 1):
            for name, runner in runners.items():
                began = time.perf_counter()
                runner.execute(step)
                if i:  # the first step of each shape warms allocator and caches
                    times[name].append((time.perf_counter() - began) * 1e3)
        eager, compiled = times["eager"], times["compiled"]
        print(f"{rows:>5} {min(eager):>10.1f} {statistics.median(eager):>10.1f} {min(compiled):>10.1f} "
              f"{statistics.median(compiled):>10.1f} {min(eager) / min(compiled):>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
