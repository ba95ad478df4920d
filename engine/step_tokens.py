"""The default token budget of one engine step (--max-num-batched-tokens), by device.

On a GPU a step of 2048 tokens takes tens of milliseconds: vLLM's server default, kept here. On a
CPU a step is compute-bound from a few dozen rows on, so its time grows with its tokens, while
every running stream waits for its next token and every prompt in the step waits for the last of
them to get its first. How long 2048 tokens take depends on how the CPU multiplies:

- with matrix tiles (AMX on a bf16 model), ~0.31 s on 2 cores for SmolLM2-135M (~0.35 s served,
  beside the event loop). The step is the unit of a burst's TTFT: its prompts get their first
  token at the step's end, in groups, and every running stream waits the step out. Such a CPU gets
  768 tokens per thread between 1536 and 2048: 1536 on 2 cores, 2048 from 3 on (measured on 2
  cores only). 2-core Sapphire Rapids, the benchmark workload at 64 streams, one server per
  budget, alternating, 4 rounds (`benchmarks/step_budget.py --budgets 1536,2048 --rounds 4`),
  medians 1536 vs 2048: TTFT p50 827 vs 913 ms, mean TTFT 894 vs 985 ms, p99 inter-token 253 vs
  331 ms, output tok/s 839.8 vs 817.1. At 1024 the throughput fell 1-2% and the TTFT p50 did not
  improve further.
- with vectors only (AVX-512 or AVX2 FMAs, or an fp32 model), ~2.3 s on 2 cores. Splitting the
  same prompts into smaller steps costs next to nothing in throughput (the weights are read once
  more per step, ~10 ms) and lets the first prompts of a burst start sooner: 2-core Xeon without
  BF16, 512 vs 2048 alternating, 3 rounds: 16 streams mean TTFT 804-832 vs 1124-1442 ms, 64
  streams TTFT p50 4.9-5.3 vs 5.2-7.5 s, output tok/s level (W64 offline 1.01x). So such a step
  gets 256 tokens per thread, between 512 and 2048: 512 on 2 cores, 2048 from 8 on.
"""

from __future__ import annotations

FULL_STEP_TOKENS = 2048  # a GPU's (vLLM's server default), and a CPU's ceiling
CPU_TOKENS_PER_THREAD = 256
CPU_STEP_TOKENS_RANGE = (512, FULL_STEP_TOKENS)
MATRIX_TILE_TOKENS_PER_THREAD = 768
MATRIX_TILE_STEP_TOKENS_RANGE = (1536, FULL_STEP_TOKENS)


def default_max_num_batched_tokens(device_type: str, cpu_threads: int, max_num_seqs: int, *,
                                   matrix_tiles: bool = False) -> int:
    """The step budget where --max-num-batched-tokens is not given. `matrix_tiles`: the CPU
    multiplies the model's dtype in matrix tiles (AMX-BF16 on a bf16 model). Never below
    max_num_seqs: a step must fit one decode token of every running request."""
    if device_type == "cpu":
        per_thread, (low, high) = ((MATRIX_TILE_TOKENS_PER_THREAD, MATRIX_TILE_STEP_TOKENS_RANGE) if matrix_tiles
                                   else (CPU_TOKENS_PER_THREAD, CPU_STEP_TOKENS_RANGE))
        budget = min(high, max(low, per_thread * cpu_threads))
    else:
        budget = FULL_STEP_TOKENS
    return max(budget, max_num_seqs)
