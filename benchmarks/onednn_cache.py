"""What oneDNN's primitive cache costs in memory and what capping it costs in time, on the
default model's packed bf16 linear shapes.

A server step multiplies [rows, in] by each weight; `rows` (the tokens of the step) takes a new
value whenever the batch changes, and oneDNN creates, and caches, one primitive per new shape
(ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1024 by default; torch's ideep layer keeps its own LRU of
computations, LRU_CACHE_CAPACITY, also 1024). Each variant runs in its own process (the libraries
read the variables once):

    python benchmarks/onednn_cache.py        # default; ONEDNN_PRIMITIVE_CACHE_CAPACITY=0; LRU_CACHE_CAPACITY=1
    python benchmarks/onednn_cache.py --variants "default;ONEDNN_PRIMITIVE_CACHE_CAPACITY=64" --rows 600
    python benchmarks/onednn_cache.py --engine --variants "A;B"   # the engine's tokens/s, A B A B

For each it prints RSS after every 100 distinct row counts (each row count through the four
per-layer weight shapes, like one layer's matmuls), then the time of a call at a row count seen before
(a cache hit, or a miss when the capacity is below the shapes in use) and at one never seen.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Variables a variant may set; the parent's values are dropped so that 'default' is the default.
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY", "MALLOC_ARENA_MAX",
                   "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")

# The default model's per-layer linear shapes (in, out): fused qkv, o, gate_up, down. lm_head is
# left out: it multiplies only the sampled rows (at most --max-num-seqs values) and is slow to run.
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def measure(rows: int, repeat_rows: int) -> dict:
    """Runs in the child: the capacity is already in the environment."""
    import torch

    from kvserve.engine.model.packed_linear import packed_linear

    torch.manual_seed(0)
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(out, inp, dtype=torch.bfloat16) * 0.02)
               for inp, out in SHAPES]

    def forward(m: int) -> None:
        for (inp, out), weight in zip(SHAPES, weights):
            packed_linear(torch.randn(m, inp, dtype=torch.bfloat16), weight, None, out)

    with torch.inference_mode():
        forward(1)
        start = rss_mib()
        curve = []
        for m in range(1, rows + 1):
            forward(m)
            if m % 100 == 0:
                curve.append((m, round(rss_mib() - start, 1)))
        # A working set of `repeat_rows` row counts cycled: all hits if the cache holds them.
        cycle = list(range(1, repeat_rows + 1))
        started = time.perf_counter()
        for _ in range(3):
            for m in cycle:
                forward(m)
        seen_ms = (time.perf_counter() - started) / (3 * len(cycle)) * 1e3
        fresh = list(range(rows + 1, rows + 41))
        started = time.perf_counter()
        for m in fresh:
            forward(m)
        fresh_ms = (time.perf_counter() - started) / len(fresh) * 1e3
    grown = rss_mib() - start
    # What glibc holds freed but not returned (fragmentation), as against what is still in use.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return {"rss_growth_mib": curve, "seen_forward_ms": round(seen_ms, 3), "new_forward_ms": round(fresh_ms, 3),
            "growth_mib": round(grown, 1), "growth_after_malloc_trim_mib": round(rss_mib() - start, 1)}


def measure_engine(num_requests: int, rounds: int) -> dict:
    """The real engine (default model, compiled forward) on fixed workloads: output tokens/s per
    round and RSS; each round's seed gives new prompt lengths, so new step shapes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput import run_kvserve_continuous
    from workload import fixed_workload

    from kvserve.engine import LLM

    llm = LLM(model="SmolLM2-135M-Instruct", max_num_seqs=16)
    run_kvserve_continuous(llm, fixed_workload(8, output_len=(4, 8), seed=100))  # warm-up
    start = rss_mib()
    rates = []
    for seed in range(rounds):
        tokens, elapsed = run_kvserve_continuous(llm, fixed_workload(num_requests, output_len=(16, 64), seed=seed))
        rates.append(round(tokens / elapsed, 1))
    return {"tokens_per_s": rates, "growth_mib": round(rss_mib() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="default;ONEDNN_PRIMITIVE_CACHE_CAPACITY=0;LRU_CACHE_CAPACITY=1",
                        help="environments to compare, ';'-separated, each 'default' or NAME=VALUE[,NAME=VALUE]")
    parser.add_argument("--rows", type=int, default=300, help="distinct row counts to run")
    parser.add_argument("--repeat-rows", type=int, default=128,
                        help="working set cycled for the hit timing (decode batches 1..N)")
    parser.add_argument("--engine", action="store_true",
                        help="instead: the engine's output tokens/s on fixed workloads, variants interleaved")
    parser.add_argument("--requests", type=int, default=32, help="--engine: requests per round")
    parser.add_argument("--rounds", type=int, default=3, help="--engine: rounds per process")
    parser.add_argument("--repeats", type=int, default=2, help="--engine: processes per variant, interleaved")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = measure_engine(args.requests, args.rounds) if args.engine else measure(args.rows, args.repeat_rows)
        print(json.dumps(result))
        return
    if args.engine:
        compare_engine(args)
        return
    for variant in args.variants.split(";"):
        out = subprocess.run([sys.executable, __file__, "--child", "--rows", str(args.rows),
                              "--repeat-rows", str(args.repeat_rows)], env=variant_env(variant), check=True,
                             capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        curve = ", ".join(f"{m}: +{growth}" for m, growth in result["rss_growth_mib"])
        print(f"{variant}: RSS MiB after N distinct row counts {{{curve}}}; at the end +{result['growth_mib']}, "
              f"+{result['growth_after_malloc_trim_mib']} after malloc_trim; the 4 matmuls at a row count seen "
              f"before {result['seen_forward_ms']} ms, at a new one {result['new_forward_ms']} ms")


def variant_env(variant: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    if variant != "default":
        env.update(item.split("=", 1) for item in variant.split(","))
    return env


def compare_engine(args: argparse.Namespace) -> None:
    variants = args.variants.split(";")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):  # A B A B: a change in the machine's load hits every variant
        for variant in variants:
            out = subprocess.run([sys.executable, __file__, "--child", "--engine", "--requests", str(args.requests),
                                  "--rounds", str(args.rounds)], env=variant_env(variant), check=True,
                                 capture_output=True, text=True).stdout
            results[variant].append(json.loads(out.strip().splitlines()[-1]))
    for variant, runs in results.items():
        rates = [rate for run in runs for rate in run["tokens_per_s"]]
        print(f"{variant}: output tokens/s per round {rates} (median {sorted(rates)[len(rates) // 2]}); "
              f"RSS growth over the rounds {[run['growth_mib'] for run in runs]} MiB")


if __name__ == "__main__":
    main()
