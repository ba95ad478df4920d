"""The fixed workload again and again through one engine: the first run finds a fresh KV cache,
the later ones a cache that earlier requests have used and given back, as a long-running engine
does. A difference between them is the cost of where the block allocator puts the later runs'
blocks (blocks handed out in release order scatter each request's K/V over memory).

    python benchmarks/repeated_runs.py [--runs 5] [--prefix-caching] [--out repeated_runs.json]

offline.py's kvserve settings (greedy, EOS ignored, a KV cache of just the blocks the workload
needs plus 64). Every run has the fixed workload's prompt and output lengths, but its own prompt
tokens (each id shifted by the run number, wrapping within the vocabulary), so with
--prefix-caching nothing hits and each run's blocks come from evicting the previous run's.
Prints each run's output tokens/s and the later runs' median over the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import run_kvserve_continuous  # noqa: E402
from workload import WorkItem, fixed_workload, kv_blocks  # noqa: E402

from kvserve.engine import LLM, SamplingParams  # noqa: E402


FIRST_TOKEN_ID, VOCAB_SIZE = 17, 49152  # workload.py's defaults: SmolLM2's 17 control ids skipped


def shifted(items: list[WorkItem], shift: int) -> list[WorkItem]:
    """The same lengths, other prompt tokens: a prefix cache finds nothing of the unshifted run."""
    span = VOCAB_SIZE - FIRST_TOKEN_ID
    return [WorkItem([FIRST_TOKEN_ID + (t - FIRST_TOKEN_ID + shift) % span for t in item.prompt_token_ids],
                     item.output_len) for item in items]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-caching", action="store_true", help="on (off by default, as in offline.py)")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs must be at least 2: the first run is the one the others are compared with")
    items = fixed_workload(num_requests=args.num_requests)
    blocks = kv_blocks(items)
    llm = LLM(max_num_seqs=max(64, args.num_requests), max_num_batched_tokens=2048, max_model_len=1024,
              enable_prefix_caching=args.prefix_caching, num_kv_blocks=blocks)
    llm.generate([[17, 18, 19, 20]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rates = []
    for run in range(1, args.runs + 1):
        tokens, seconds = run_kvserve_continuous(llm, shifted(items, run - 1))
        rates.append(tokens / seconds)
        print(f"run {run}: {rates[-1]:.1f} output tokens/s", flush=True)
    later = statistics.median(rates[1:])
    print(f"later runs' median / first run: {later / rates[0]:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"prefix_caching": args.prefix_caching, "num_kv_blocks": blocks,
                                        "tokens_per_s": rates, "later_over_first": later / rates[0]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
