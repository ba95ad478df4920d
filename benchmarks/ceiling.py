"""How close does kvserve come to the matmul-bound ceiling on the fixed workload?

    python benchmarks/ceiling.py [--num-requests 64] [--out results/ceiling.json]

1. Times torch's bf16 `F.linear` on SmolLM2's own weight shapes (fused qkv, o, gate_up, down, and
   lm_head) at the row counts a step sees (1, 16, 64, 256): minimum of --repeats runs each.
2. The workload's matmul-bound ceiling: every prompt and output token passes once through the 30
   layers' four projections, and every output token once through lm_head (only sampled rows reach
   it). At R rows per matmul that costs tokens x (time at R rows / R); the ceiling in output
   tokens/s is output tokens / that time. R = 64 is the headline (W64's decode batch size); the
   other row counts show how the ceiling moves with batch size.
3. Single-stream floor: one bf16 `F.linear` with one row over every weight matrix (each its own
   tensor, so all ~270 MB stream from memory as in a real decode step). Ceiling and floor are also
   printed with oneDNN-prepacked weights (what kvserve's CPU bf16 layers run; F.linear reorders
   each weight on every call), which are lower: the fair bar for kvserve.
4. kvserve offline on the same workload, in the same process, after the timings: its tokens/s
   and the fraction of each ceiling it reaches.
Writes everything as JSON with --out (run_all.py puts it in the report).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import ALL_SHAPES, LAYER_SHAPES, LM_HEAD, time_linear, weight_pass_floor_s  # noqa: E402
from offline import bench_kvserve  # noqa: E402
from workload import fixed_workload  # noqa: E402

ROW_COUNTS = (1, 16, 64, 256)
HEADLINE_ROWS = 64


def matmul_timings(repeats: int, packed: bool = False) -> dict[int, dict[str, float]]:
    """rows -> shape name -> seconds per matmul."""
    return {rows: {s.name: time_linear(s, rows, repeats, packed=packed) for s in ALL_SHAPES} for rows in ROW_COUNTS}


def ceiling_tokens_per_s(timings: dict[str, float], rows: int, input_tokens: int, output_tokens: int) -> float:
    per_token_layers = sum(timings[s.name] * s.per_forward for s in LAYER_SHAPES) / rows
    per_token_head = timings[LM_HEAD.name] / rows
    seconds = (input_tokens + output_tokens) * per_token_layers + output_tokens * per_token_head
    return output_tokens / seconds


def gflops(shape_name: str, rows: int, seconds: float) -> float:
    shape = next(s for s in ALL_SHAPES if s.name == shape_name)
    return 2 * rows * shape.out_features * shape.in_features / seconds / 1e9


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=_pair, default=(16, 256), help="LOW,HIGH tokens")
    parser.add_argument("--output-len", type=_pair, default=(16, 256), help="LOW,HIGH tokens")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-kvserve", action="store_true", help="timings and ceiling only")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)

    items = fixed_workload(num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len)
    input_tokens = sum(len(i.prompt_token_ids) for i in items)
    output_tokens = sum(i.output_len for i in items)
    print(f"workload: {len(items)} requests, {input_tokens} prompt + {output_tokens} output tokens; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    timings = matmul_timings(args.repeats)
    print("\nbf16 F.linear, ms per matmul (GFLOP/s)")
    print("| rows | " + " | ".join(f"{s.name} {s.out_features}x{s.in_features}" for s in ALL_SHAPES) + " |")
    print("|---|" + "---|" * len(ALL_SHAPES))
    for rows, by_shape in timings.items():
        cells = " | ".join(f"{t * 1e3:.3f} ({gflops(n, rows, t):.0f})" for n, t in by_shape.items())
        print(f"| {rows} | {cells} |")
    ceilings = {rows: ceiling_tokens_per_s(timings[rows], rows, input_tokens, output_tokens) for rows in ROW_COUNTS}
    floor_s = weight_pass_floor_s()
    print(f"\nsingle-stream floor (one bf16 row through every weight matrix): {floor_s * 1e3:.1f} ms/token")
    # kvserve's CPU bf16 layers multiply by oneDNN-prepacked weights, which skips the per-call
    # weight reorder F.linear pays: the same ceiling and floor with those matmuls, for comparison.
    packed_timings = matmul_timings(args.repeats, packed=True)
    packed_ceilings = {rows: ceiling_tokens_per_s(packed_timings[rows], rows, input_tokens, output_tokens)
                       for rows in ROW_COUNTS}
    packed_floor_s = weight_pass_floor_s(packed=True)
    print("with prepacked weights (what kvserve runs): ceiling at " + ", ".join(
        f"{rows} rows {c:.1f}" for rows, c in packed_ceilings.items()) + f" output tokens/s; "
        f"single-stream floor {packed_floor_s * 1e3:.1f} ms/token")

    kvserve_tps = None
    if not args.skip_kvserve:
        rows = bench_kvserve(items, "bfloat16", ())
        kvserve_tps = rows[0]["tokens_per_s"]
    print("\n| matmul rows | ceiling (output tokens/s) | kvserve reaches |")
    print("|---|---|---|")
    for rows, ceiling in ceilings.items():
        reached = f"{kvserve_tps / ceiling:.0%}" if kvserve_tps else "n/a"
        print(f"| {rows}{' (headline)' if rows == HEADLINE_ROWS else ''} | {ceiling:.1f} | {reached} |")
    if kvserve_tps:
        print(f"with prepacked weights kvserve reaches {kvserve_tps / packed_ceilings[HEADLINE_ROWS]:.0%} of the "
              f"{HEADLINE_ROWS}-row ceiling")
        print(f"kvserve offline: {kvserve_tps:.1f} output tokens/s = {kvserve_tps / ceilings[HEADLINE_ROWS]:.0%} "
              f"of the {HEADLINE_ROWS}-row ceiling")

    if args.out:
        result: dict[str, Any] = {
            "threads": torch.get_num_threads(), "input_tokens": input_tokens, "output_tokens": output_tokens,
            "shapes": [{"name": s.name, "out_features": s.out_features, "in_features": s.in_features,
                        "per_forward": s.per_forward} for s in ALL_SHAPES],
            "matmul_ms": {str(r): {n: t * 1e3 for n, t in by.items()} for r, by in timings.items()},
            "ceiling_tokens_per_s": {str(r): c for r, c in ceilings.items()}, "headline_rows": HEADLINE_ROWS,
            "single_stream_floor_ms": floor_s * 1e3, "kvserve_tokens_per_s": kvserve_tps,
            "packed_matmul_ms": {str(r): {n: t * 1e3 for n, t in by.items()} for r, by in packed_timings.items()},
            "packed_ceiling_tokens_per_s": {str(r): c for r, c in packed_ceilings.items()},
            "packed_single_stream_floor_ms": packed_floor_s * 1e3,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
