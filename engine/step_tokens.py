"""The default token budget of one engine step (--max-num-batched-tokens), by device.

On a GPU a step of 2048 tokens takes tens of milliseconds: vLLM's server default, kept here. On a
CPU a step is compute-bound from a few dozen rows on, so its time grows with its tokens: on 2
cores a 2048-token step of SmolLM2-135M takes ~2.3 s, while every running stream waits for its
next token and every prompt in the step waits for the last of them to get its first. Splitting
the same prompts into smaller steps costs next to nothing in throughput (the weights are read
once more per step, ~10 ms) and lets the first prompts of a burst start sooner. Measured (2-core
Xeon, the benchmark workload, kvserve serve, 3 alternating rounds, 512 vs 2048 tokens a step):
16 streams mean TTFT 804-832 vs 1124-1442 ms, 64 streams TTFT p50 4.9-5.3 vs 5.2-7.5 s, output
tok/s level (W64 offline 1.01x); one 4000-token prompt alone 2-3% slower (more chunks). So a CPU
step gets 256 tokens per thread, between 512 and 2048: 512 on 2 cores, 2048 from 8 on.
"""

from __future__ import annotations

GPU_STEP_TOKENS = 2048
CPU_TOKENS_PER_THREAD = 256
CPU_STEP_TOKENS_RANGE = (512, 2048)


def default_max_num_batched_tokens(device_type: str, cpu_threads: int, max_num_seqs: int) -> int:
    """The step budget where --max-num-batched-tokens is not given. Never below max_num_seqs: a
    step must fit one decode token of every running request."""
    if device_type == "cpu":
        low, high = CPU_STEP_TOKENS_RANGE
        budget = min(high, max(low, CPU_TOKENS_PER_THREAD * cpu_threads))
    else:
        budget = GPU_STEP_TOKENS
    return max(budget, max_num_seqs)
