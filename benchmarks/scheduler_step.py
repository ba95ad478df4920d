"""Scheduler + block allocator time per step with N running requests in steady decode.

The model is a fake (next token = a cheap function of the last one) and is not timed: the figure
is what the pure-Python scheduling work (schedule() + update_from_output(), including the KV
cache manager's allocate_slots and prefix-cache registration) adds to every model step.

    python benchmarks/scheduler_step.py                    # 256 requests, 128-token prompts
    python benchmarks/scheduler_step.py --num-requests 64 --no-prefix-caching
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve.paging import KVCacheManager
from kvserve.scheduler import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput

VOCAB_SIZE = 49152


def fake_model(output: SchedulerOutput) -> ModelRunnerOutput:
    """Next token: a function of the token the step diff brought (the last one sent)."""
    sampling = [r for r in output.scheduled if r.samples]
    tokens = [[(r.new_token_ids[-1] * 31 + 7) % VOCAB_SIZE] for r in sampling]
    return ModelRunnerOutput([r.request_id for r in sampling], tokens, [None] * len(sampling))


def build(args: argparse.Namespace) -> Scheduler:
    max_model_len = args.prompt_len + args.warmup_steps + args.steps + 8
    blocks_per_request = -(-max_model_len // args.block_size)
    kv = KVCacheManager(args.num_requests * blocks_per_request + 1, args.block_size, not args.no_prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=max(args.num_requests, 8192),
        max_model_len=max_model_len,
    )
    scheduler = Scheduler(config, kv)
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(args.num_requests):
        # Distinct prompts: no prefix hits, so every request keeps its own blocks.
        prompt = [(i * 7919 + j * 104729) % VOCAB_SIZE for j in range(args.prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, eos_token_ids=(2,), arrival_time=float(i)))
    return scheduler


def step(scheduler: Scheduler) -> tuple[float, int]:
    """One step; returns (seconds spent in the scheduler, requests scheduled)."""
    start = time.perf_counter()
    output = scheduler.schedule()
    scheduled = time.perf_counter()
    runner_output = fake_model(output)
    resumed = time.perf_counter()
    scheduler.update_from_output(output, runner_output)
    end = time.perf_counter()
    return (scheduled - start) + (end - resumed), len(output.scheduled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()

    scheduler = build(args)
    for _ in range(args.warmup_steps):  # prefill everything, then a few decode steps
        step(scheduler)
    if scheduler.num_running != args.num_requests:
        raise SystemExit(f"only {scheduler.num_running} of {args.num_requests} requests running after warm-up; "
                         "raise --warmup-steps")
    timings = []
    for _ in range(args.steps):
        seconds, num_scheduled = step(scheduler)
        if num_scheduled != args.num_requests:
            raise SystemExit(f"a decode step scheduled {num_scheduled} requests, expected {args.num_requests}")
        timings.append(seconds)
    timings.sort()
    mean = statistics.fmean(timings)
    p50, p99 = timings[len(timings) // 2], timings[min(len(timings) - 1, int(len(timings) * 0.99))]
    caching = "off" if args.no_prefix_caching else "on"
    print(f"scheduler+allocator per decode step, {args.num_requests} running requests, "
          f"block size {args.block_size}, prefix caching {caching}, {args.steps} steps:")
    print(f"  mean {mean * 1e3:.3f} ms   p50 {p50 * 1e3:.3f} ms   p99 {p99 * 1e3:.3f} ms   "
          f"({mean / args.num_requests * 1e6:.2f} us per request)")


if __name__ == "__main__":
    main()
