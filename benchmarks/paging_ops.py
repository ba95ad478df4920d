"""Micro-benchmark of the paging bookkeeping (pure Python, no model, no GPU).

    python benchmarks/paging_ops.py [--requests 256] [--prompt-len 512] [--steps 256] [--json out.json]

Prints operations per second for block allocate/free, whole-prompt allocation and prefix
lookups, and the allocator's cost per scheduler step with `--requests` running requests each
decoding one token (what KVCacheManager adds to every model step).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kvserve.paging import BlockAllocator, KVCacheManager


def rate(operation: Callable[[], int], min_seconds: float = 0.3) -> float:
    """Operations per second: `operation` runs a batch and returns how many operations it did."""
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        done += operation()
    return done / elapsed


def bench_block_allocate_free(num_blocks: int) -> float:
    allocator = BlockAllocator(num_blocks)

    def batch() -> int:
        blocks = [allocator.allocate() for _ in range(num_blocks)]
        for block in blocks:
            allocator.release(block)
        return 2 * num_blocks

    return rate(batch)


def bench_prompt_allocate_free(prompt_len: int, block_size: int, prefix_caching: bool) -> float:
    """Requests per second through allocate_slots(whole prompt) + free, all prompts distinct."""
    manager = KVCacheManager(64 * (prompt_len // block_size + 1), block_size, enable_prefix_caching=prefix_caching)
    counter = iter(range(10**12))

    def batch() -> int:
        ids = []
        for _ in range(32):
            n = next(counter)
            prompt = [n] + [7] * (prompt_len - 1)  # distinct first token: no prefix hits
            request_id = f"r{n}"
            manager.allocate_slots(request_id, prompt, 0, prompt_len)
            ids.append(request_id)
        for request_id in ids:
            manager.free(request_id)
        return 32

    return rate(batch)


def bench_prefix_lookup(prompt_len: int, block_size: int) -> float:
    manager = KVCacheManager(4 * (prompt_len // block_size + 1), block_size)
    prompt = list(range(prompt_len + 1))
    manager.allocate_slots("warm", prompt, 0, len(prompt))
    blocks, _ = manager.get_computed_blocks(prompt)
    assert len(blocks) == prompt_len // block_size, "the warm-up prompt should be fully cached"

    def batch() -> int:
        for _ in range(16):
            manager.get_computed_blocks(prompt)
        return 16

    return rate(batch)


def bench_decode_steps(num_requests: int, prompt_len: int, num_steps: int, block_size: int) -> tuple[float, float, float]:
    """Seconds per step (mean, median, 99th percentile) of allocate_slots for every running
    request, one new token each, plus one stats() call, as the scheduler would do per step.
    The steps cross block boundaries (new blocks, full blocks hashed and cached) like real ones."""
    blocks_per_request = -(-(prompt_len + num_steps) // block_size)
    manager = KVCacheManager(num_requests * blocks_per_request + 16, block_size)
    rng = random.Random(0)
    system_prompt = [rng.randrange(49152) for _ in range(prompt_len // 2)]  # shared: prefix hits
    tokens: dict[str, list[int]] = {}
    for index in range(num_requests):
        request_id = f"r{index}"
        prompt = system_prompt + [rng.randrange(49152) for _ in range(prompt_len - len(system_prompt))]
        blocks, num_cached = manager.get_computed_blocks(prompt)
        manager.allocate_slots(request_id, prompt, num_cached, len(prompt) - num_cached, blocks)
        tokens[request_id] = prompt
    step_times = []
    for _ in range(num_steps):
        for request_tokens in tokens.values():
            request_tokens.append(rng.randrange(49152))
        start = time.perf_counter()
        for request_id, request_tokens in tokens.items():
            if manager.allocate_slots(request_id, request_tokens, len(request_tokens) - 1, 1) is None:
                raise RuntimeError("the benchmark's cache is too small")
        manager.stats()
        step_times.append(time.perf_counter() - start)
    ordered = sorted(step_times)
    return sum(ordered) / len(ordered), statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    results = {
        "block_allocate_free_ops_per_s": bench_block_allocate_free(4096),
        "prompt_allocate_free_req_per_s": bench_prompt_allocate_free(args.prompt_len, args.block_size, prefix_caching=True),
        "prompt_allocate_free_req_per_s_no_prefix_caching": bench_prompt_allocate_free(args.prompt_len, args.block_size, prefix_caching=False),
        "prefix_lookup_per_s": bench_prefix_lookup(args.prompt_len, args.block_size),
    }
    mean_step, median_step, p99_step = bench_decode_steps(args.requests, args.prompt_len, args.steps, args.block_size)
    results |= {"decode_step_mean_ms": mean_step * 1e3, "decode_step_median_ms": median_step * 1e3, "decode_step_p99_ms": p99_step * 1e3}

    blocks = args.prompt_len // args.block_size
    print(f"block allocate+release (BlockAllocator)        {results['block_allocate_free_ops_per_s']:>12,.0f} ops/s")
    print(f"{args.prompt_len}-token prompt allocate_slots + free      {results['prompt_allocate_free_req_per_s']:>12,.0f} requests/s "
          f"(prefix caching on: hashes {blocks} blocks each)")  # fmt: skip
    print(f"{args.prompt_len}-token prompt allocate_slots + free      "
          f"{results['prompt_allocate_free_req_per_s_no_prefix_caching']:>12,.0f} requests/s (prefix caching off)")  # fmt: skip
    print(f"prefix lookup, {blocks}-block hit                  {results['prefix_lookup_per_s']:>12,.0f} lookups/s")
    print(
        f"decode step, {args.requests} running requests         {results['decode_step_median_ms']:>12.3f} ms/step median "
        f"({results['decode_step_median_ms'] * 1e3 / args.requests:.2f} us/request), mean {results['decode_step_mean_ms']:.3f} ms, "
        f"p99 {results['decode_step_p99_ms']:.3f} ms"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
