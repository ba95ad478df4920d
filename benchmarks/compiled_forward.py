"""Decode-step time, eager vs compiled forward (issue 12), interleaved in one process.

    python benchmarks/compiled_forward.py [--rows 1 16 64 256] [--context 256] [--dtype bfloat16] [--dense]

Runners over copies of the model, one compiled (engine/compilation.py); each step is a full
ModelRunner.execute of `rows` single-token decodes at `context` tokens of context (metadata,
forward, logits, greedy sampling). Weights are prepacked for oneDNN as the engine does
(engine/model/packed_linear.py); --dense adds eager and compiled runners with plain F.linear
weights, to measure what packing buys. The runners alternate step by step, so machine noise hits
all alike; the table shows the minimum and median per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import resolve_model
from kvserve.engine.model.packed_linear import pack_linear_weights
from kvserve.engine.worker.kv_cache_sizing import kv_cache_config_for
from kvserve.engine.model_runner import ModelRunner
from kvserve.kernels import select_attention_backend
from kvserve.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput
from kvserve.scheduler.sampling_params import SamplingParams

BLOCK_SIZE = 16


def make_runner(model_name: str, dtype: torch.dtype, num_blocks: int, compiled: bool, packed: bool) -> ModelRunner:
    config, model = load_model(resolve_model(model_name), dtype, torch.device("cpu"))
    if packed:
        pack_linear_weights(model)
    runner = ModelRunner(model, config, kv_cache_config_for(model, num_blocks, BLOCK_SIZE, dtype), dtype,
                         select_attention_backend("torch", torch.device("cpu")),
                         torch.device("cpu"), eos_token_ids=(), compiled=compiled)
    runner.warm_up()
    return runner


def decode_step(runners: list[ModelRunner], rows: int, context: int) -> SchedulerOutput:
    """`rows` requests, each decoding its token at position `context` through its own blocks:
    registered with each runner once (their prompts never computed: the step is what is timed),
    then the same step again and again (a diff that adds nothing)."""
    blocks = context // BLOCK_SIZE + 1
    greedy = SamplingParams(temperature=0.0)
    register = SchedulerOutput(
        scheduled=[ScheduledRequest(f"{rows}-{i}", context, 1, True, [1] * context + [100 + i],
                                    (tuple(range(i * blocks, (i + 1) * blocks)),), True) for i in range(rows)],
        new_requests=[NewRequestData(f"{rows}-{i}", context, greedy, 0) for i in range(rows)])
    for runner in runners:
        runner.input_batch.apply(register)
    return SchedulerOutput([ScheduledRequest(f"{rows}-{i}", context, 1, True, [], (), False) for i in range(rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dense", action="store_true", help="also run with plain F.linear weights")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    num_blocks = max(args.rows) * (args.context // BLOCK_SIZE + 1)
    start = time.perf_counter()
    variants = [("eager", False, True), ("compiled", True, True)]
    if args.dense:
        variants += [("eager dense", False, False), ("compiled dense", True, False)]
    runners = {name: make_runner(args.model, dtype, num_blocks, compiled=compiled, packed=packed)
               for name, compiled, packed in variants}
    print(f"set-up incl. compile: {time.perf_counter() - start:.1f} s; torch threads: {torch.get_num_threads()}")
    print("ms per step, min / median; speed-up of compiled over eager by the minimum")
    print("| rows | " + " | ".join(runners) + " | compiled speed-up |")
    print("|---|" + "---|" * (len(runners) + 1))
    for rows in args.rows:
        step = decode_step(list(runners.values()), rows, args.context)
        times: dict[str, list[float]] = {name: [] for name in runners}
        for i in range(args.steps + 1):
            for name, runner in runners.items():
                began = time.perf_counter()
                runner.execute(step)
                if i:  # the first step of each shape warms allocator and caches
                    times[name].append((time.perf_counter() - began) * 1e3)
        cells = " | ".join(f"{min(t):.1f} / {statistics.median(t):.1f}" for t in times.values())
        print(f"| {rows} | {cells} | {min(times['eager']) / min(times['compiled']):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
