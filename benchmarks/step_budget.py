"""What the step budget (--max-num-batched-tokens) does to a burst of streams: one `kvserve serve`
per budget, all running at once (idle ones wait on their queues), and the fixed workload sent to
each in turn (A, B, A, B, ...) at N concurrent streams. Prints, per run, output tokens/s, TTFT p50
and mean, and the p99 gap between a stream's tokens, then each budget's medians.

    OMP_NUM_THREADS=2 python benchmarks/step_budget.py --budgets 1536,2048 --rounds 3

Why it matters on a CPU: a step is compute-bound, so its time grows with its tokens. A burst's
prompts get their first token at the end of the step that finishes them, in groups (TTFT p50 over
64 requests lands on one group's boundary or the next), and every running stream waits each step
out. engine/step_tokens.py chooses the default from such runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import KvserveServerOptions, ServerProcess, free_port, kvserve_serve_argv, stream_workload  # noqa: E402
from workload import WorkItem, fixed_workload, kv_blocks  # noqa: E402

from kvserve.loadtest.metrics import LatencyStats  # noqa: E402


@dataclass(frozen=True)
class BurstFigures:
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_mean_ms: float
    itl_p99_ms: float


def run_burst(base_url: str, items: list[WorkItem], streams: int) -> BurstFigures:
    ok, seconds = stream_workload(base_url, items, max_concurrency=streams)
    ttft = LatencyStats.of([r.ttft_s for r in ok], [50])
    gaps = LatencyStats.of([gap for r in ok for gap in r.itl_s], [99])
    return BurstFigures(sum(r.output_tokens for r in ok) / seconds, ttft.percentiles_ms[50], ttft.mean_ms,
                        gaps.percentiles_ms[99])


def budgets_arg(text: str) -> list[int]:
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated token counts, got {text!r}") from None
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"at least one budget, each >= 1, got {text!r}")
    return budgets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=budgets_arg, default=[1536, 2048], help="comma-separated tokens per step")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--warmups", type=int, default=1,
                   help="discarded bursts sent to each server before the measured rounds: a fresh server's "
                        "first burst pays page faults and kernel set-up that later ones do not")
    args = p.parse_args()
    if args.warmups < 0:
        p.error("--warmups must be >= 0")
    items = fixed_workload(args.num_requests)
    options = KvserveServerOptions(dtype=args.dtype, max_num_seqs=max(64, args.streams), num_kv_blocks=kv_blocks(items))
    figures: dict[int, list[BurstFigures]] = {budget: [] for budget in args.budgets}
    with ExitStack() as stack:
        urls = {}
        for budget in args.budgets:
            port = free_port()
            argv = kvserve_serve_argv(port, options) + ["--max-num-batched-tokens", str(budget)]
            urls[budget] = stack.enter_context(ServerProcess(argv, port, Path("/tmp") / f"step_budget_{port}.log"))
        for _ in range(args.warmups):
            for budget in args.budgets:
                run_burst(urls[budget], items, args.streams)
        for round_ in range(args.rounds):
            for budget in args.budgets:
                run = run_burst(urls[budget], items, args.streams)
                figures[budget].append(run)
                print(f"round {round_ + 1}: {budget:5d} tokens/step  {run.output_tokens_per_s:6.1f} tok/s  "
                      f"TTFT p50 {run.ttft_p50_ms:6.0f} ms, mean {run.ttft_mean_ms:6.0f} ms  "
                      f"p99 inter-token {run.itl_p99_ms:5.0f} ms", flush=True)
    print("medians over the rounds:")
    for budget, runs in figures.items():
        print(f"  {budget:5d} tokens/step  {statistics.median(r.output_tokens_per_s for r in runs):6.1f} tok/s  "
              f"TTFT p50 {statistics.median(r.ttft_p50_ms for r in runs):6.0f} ms, "
              f"mean {statistics.median(r.ttft_mean_ms for r in runs):6.0f} ms  "
              f"p99 inter-token {statistics.median(r.itl_p99_ms for r in runs):5.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
