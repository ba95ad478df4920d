"""What tensor parallelism costs per step: all_reduce latency, and TP=1 vs TP=N step time.

    python benchmarks/tensor_parallel.py                  # SmolLM2-135M (9 heads / 3 KV heads): TP=3
    python benchmarks/tensor_parallel.py --model /models/llama --tp 2 --batch-sizes 1,8,32

1. all_reduce: N processes in one gloo (CPU) or NCCL (CUDA) group, each all_reduce of a
   [batch, hidden] tensor in the model dtype timed (median of --iterations). A decode step makes
   2 per layer (after o_proj and down_proj) and 1 for the embedding, so the collective cost per
   step is about (2 x layers + 1) x that latency (plus the lm_head's all_gather of the logits).
2. Engine steps: a TP=1 and a TP=N engine side by side, each with `batch` running requests in
   decode; steps alternate between them (A, B, A, B, ...) so machine noise hits both alike, and
   the median step time of each is reported.
On a machine with fewer cores than ranks x threads, TP is slower, not faster: what this measures
there is the overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.engine import EngineConfig, LLMEngine, SamplingParams
from kvserve.engine.device import resolve_device, resolve_dtype
from kvserve.engine.model.registry import load_model_config
from kvserve.engine.model.model_source import resolve_model
from kvserve.engine.parallel.process_group import free_loopback_port, join_group, leave_group, rank_device


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--iterations", type=int, default=200, help="all_reduces timed per batch size")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per engine and batch size")
    args = parser.parse_args(argv)
    if args.tp < 2:
        parser.error("--tp must be at least 2")
    return args


def _all_reduce_rank(rank: int, world: int, port: int, device_name: str, dtype: torch.dtype, hidden: int,
                     batches: list[int], iterations: int, results: "mp.Queue[tuple[int, float]]") -> None:
    device = rank_device(torch.device(device_name), rank)
    join_group(device, rank, world, port)
    try:
        for batch in batches:
            x = torch.randn(batch, hidden, dtype=dtype, device=device)
            for _ in range(10):
                dist.all_reduce(x)
            timings = []
            for _ in range(iterations):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                dist.all_reduce(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                timings.append(time.perf_counter() - start)
            if rank == 0:
                results.put((batch, statistics.median(timings)))
    finally:
        leave_group()


def all_reduce_latency(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, hidden: int,
                       batches: list[int]) -> dict[int, float]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_loopback_port()
    processes = [context.Process(target=_all_reduce_rank, args=(rank, args.tp, port, str(device), dtype, hidden,
                                                                batches, args.iterations, results))
                 for rank in range(args.tp)]
    for process in processes:
        process.start()
    latencies = dict(results.get(timeout=600) for _ in batches)
    for process in processes:
        process.join(60)
    return latencies


def step_times(args: argparse.Namespace, batches: list[int]) -> dict[int, tuple[float, float]]:
    """batch -> (median TP=1 step, median TP=N step), decode steps interleaved."""
    def engine(size: int) -> LLMEngine:
        return LLMEngine.from_config(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                                  num_kv_blocks=1024, max_model_len=1024, tensor_parallel_size=size))

    engines = [engine(1), engine(args.tp)]
    try:
        results = {}
        for batch in batches:
            params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
            for index, eng in enumerate(engines):
                for i in range(batch):
                    eng.add_request(f"{batch}-{index}-{i}", [11 + i, 12, 13, 14, 15, 16, 17, 18], params)
                eng.step()  # the prefill step, not timed
            timings: list[list[float]] = [[], []]
            for _ in range(args.steps):
                for index, eng in enumerate(engines):
                    start = time.perf_counter()
                    eng.step()
                    timings[index].append(time.perf_counter() - start)
            for eng in engines:
                while eng.has_unfinished_requests():
                    eng.step()
            results[batch] = (statistics.median(timings[0]), statistics.median(timings[1]))
        return results
    finally:
        for eng in engines:
            eng.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device)
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    shape = load_model_config(resolve_model(args.model).path)
    latency = all_reduce_latency(args, device, dtype, shape.hidden_size, batches)
    steps = step_times(args, batches)
    per_step = 2 * shape.num_layers + 1
    print(f"\n{args.model}: {shape.num_layers} layers, hidden {shape.hidden_size}, {dtype}, {device}, TP={args.tp} "
          f"({'NCCL' if device.type == 'cuda' else 'gloo'}); {per_step} all_reduces and 1 all_gather per step\n")
    print("| batch | all_reduce us | collectives per step ms | TP=1 step ms | TP=%d step ms |" % args.tp)
    print("|---|---|---|---|---|")
    for batch in batches:
        one, many = steps[batch]
        print(f"| {batch} | {latency[batch] * 1e6:.0f} | {per_step * latency[batch] * 1e3:.2f} | "
              f"{one * 1e3:.1f} | {many * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
