"""Where a W64 offline run's wall time goes: one run of the fixed workload through LLM.generate
(offline.py's settings), with a per-step timeline summed by step kind and decode batch size.

    python benchmarks/step_timeline.py [--num-requests 64] [--max-num-batched-tokens 2048]
                                       [--max-num-seqs 64] [--out step_timeline.json]

The timeline comes from the engine's own per-step stats records (a StatsListener appended to the
engine; no engine code changes): rows scheduled, prompt tokens computed, requests running, step
duration (schedule + forward + sample + update + detokenize). Step kinds:
  prefill   only prompt tokens (no decoding request in the step)
  mixed     prompt chunks and decodes in one step
  decode    decodes only, bucketed by rows (1-8, 9-16, 17-32, 33-48, 49-64, ...)
"Outside steps" is the wall time minus the sum of step durations (LLM.generate's own loop: adding
requests, accumulating outputs). --out writes the summary and the raw timeline as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import params_for  # noqa: E402
from workload import fixed_workload, kv_blocks  # noqa: E402

from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine.stats import FinishedRequestStats, StepStats  # noqa: E402

BUCKETS = (1, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)


class Timeline:
    """Collects one record per engine step (the engine calls on_step after each)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_step(self, stats: StepStats) -> None:
        self.steps.append({"ms": stats.duration_s * 1e3, "tokens": stats.num_scheduled_tokens,
                           "prompt_tokens": stats.num_prompt_tokens,
                           "decode_rows": stats.num_scheduled_tokens - stats.num_prompt_tokens,
                           "running": stats.num_running, "waiting": stats.num_waiting})

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        pass


def bucket(rows: int) -> str:
    low = 1
    for high in BUCKETS:
        if rows <= high:
            return f"decode {low}-{high} rows"
        low = high + 1
    return f"decode >{BUCKETS[-1]} rows"


def summarize(steps: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for step in steps:
        if step["prompt_tokens"] and step["decode_rows"]:
            groups["mixed prefill+decode"].append(step)
        elif step["prompt_tokens"]:
            groups["prefill only"].append(step)
        else:
            groups[bucket(step["decode_rows"])].append(step)
    total_ms = wall_s * 1e3
    rows = {}
    for name in sorted(groups, key=lambda n: (not n.startswith(("prefill", "mixed")), _low(n))):
        group = groups[name]
        ms = sum(s["ms"] for s in group)
        rows[name] = {"steps": len(group), "ms": round(ms, 1), "share": round(ms / total_ms, 3),
                      "ms_per_step": round(ms / len(group), 2),
                      "tokens": sum(s["tokens"] for s in group),
                      "prompt_tokens": sum(s["prompt_tokens"] for s in group),
                      "decode_rows": sum(s["decode_rows"] for s in group)}
    outside = total_ms - sum(s["ms"] for s in steps)
    rows["outside steps"] = {"steps": 0, "ms": round(outside, 1), "share": round(outside / total_ms, 3)}
    return rows


def _low(name: str) -> int:
    digits = name.split()[1].lstrip(">").split("-")[0] if name.startswith("decode") else "0"
    return int(digits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: max(64, requests), as offline.py")
    parser.add_argument("--model", help="default: the bundled GGUF")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    items = fixed_workload(num_requests=args.num_requests)
    blocks = kv_blocks(items)
    llm = LLM(**({"model": args.model} if args.model else {}), dtype=args.dtype,
              max_num_seqs=args.max_num_seqs or max(64, len(items)),
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, max_model_len=1024,
              num_kv_blocks=blocks)
    llm.generate([items[0].prompt_token_ids], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    timeline = Timeline()
    llm.engine.stats_listeners.append(timeline)
    start = time.perf_counter()
    outputs = llm.generate([i.prompt_token_ids for i in items], [params_for(i) for i in items], use_tqdm=False)
    wall_s = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = summarize(timeline.steps, wall_s)
    print(f"{len(items)} requests, {tokens} output tokens in {wall_s:.2f} s: {tokens / wall_s:.1f} tokens/s, "
          f"{len(timeline.steps)} steps")
    print(f"{'step kind':<26}{'steps':>7}{'ms':>10}{'share':>8}{'ms/step':>9}{'tokens':>8}{'prompt':>8}")
    for name, entry in summary.items():
        print(f"{name:<26}{entry['steps']:>7}{entry['ms']:>10.1f}{entry['share']:>8.1%}"
              f"{entry.get('ms_per_step', 0):>9.1f}{entry.get('tokens', 0):>8}{entry.get('prompt_tokens', 0):>8}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"requests": len(items), "output_tokens": tokens, "wall_s": wall_s,
                                        "max_num_batched_tokens": args.max_num_batched_tokens,
                                        "summary": summary, "timeline": timeline.steps}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
