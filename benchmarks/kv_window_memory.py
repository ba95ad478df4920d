"""KV bytes one request holds vs its context length, global and sliding-window layers apart,
measured on the engine's own block bookkeeping (paging/KVCacheManager, no model, no GPU).

    python benchmarks/kv_window_memory.py [--models mistral-7b-v0.1 gemma-3-4b] [--max-tokens 10240]
        [--window 1024] [--prompt-len 512] [--chunk 512] [--kv-dtype-bytes 2] [--json out.json] [--plot out.png]

For each model (a `kvserve kv-size` preset; `--window` adds a synthetic model with one global
layer and 7 window layers of that window), one request's prompt is prefilled in `--chunk`-token
steps and then decoded one token a step up to --max-tokens, as the scheduler would run it alone. After
every step the blocks its tables hold in each layer group are counted and turned into bytes (the
group's layers x one layer's page). Printed: bytes held by the global and the window layers at
each power-of-two context length, the window groups' block count against ceil((w - 1) / 16) + 1,
and what the same layers would hold as global ones. With --plot (matplotlib, if installed; else
it says so and skips the plot), the two curves per model.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvserve.paging import KVCacheManager, SlidingWindowSpec, group_layers
from kvserve.paging.kv_sizing import PRESETS, ModelShape

BLOCK_SIZE = 16


def measure(shape: ModelShape, max_tokens: int, prompt_len: int, chunk: int, dtype_bytes: int) -> list[dict]:
    """One row per step (a prompt of `prompt_len` tokens in `chunk`-token steps, then decodes):
    context length, bytes held by global and window layers, and the most blocks any window
    group's table holds."""
    groups = group_layers(shape.layer_specs(dtype_bytes))
    specs = [group.spec for group in groups]
    needed = sum(spec.max_num_blocks(max_tokens, BLOCK_SIZE, chunk) for spec in specs)
    manager = KVCacheManager(needed, BLOCK_SIZE, enable_prefix_caching=False, group_specs=specs)
    tokens = [i % 1000 for i in range(max_tokens)]
    rows, computed = [], 0
    prompt_len = min(prompt_len, max_tokens)
    while computed < max_tokens:
        step = min(chunk, prompt_len - computed) if computed < prompt_len else 1
        if manager.allocate_slots("r", tokens, computed, step) is None:
            raise RuntimeError(f"{shape.name}: {needed} blocks did not hold the request at {computed} tokens")
        computed += step
        held = [sum(block is not None for block in manager.block_ids("r", g)) for g in range(len(groups))]
        global_bytes = window_bytes = 0
        for group, count in zip(groups, held):
            page = group.spec.page_bytes(BLOCK_SIZE) * len(group.layer_indices)
            if isinstance(group.spec, SlidingWindowSpec):
                window_bytes += count * page
            else:
                global_bytes += count * page
        window_blocks = max((count for group, count in zip(groups, held) if isinstance(group.spec, SlidingWindowSpec)),
                            default=0)
        rows.append({"tokens": computed, "global_bytes": global_bytes, "window_bytes": window_bytes,
                     "window_group_blocks": window_blocks, "decoding": step == 1 and computed > prompt_len})
    manager.free("r")
    assert manager.stats().blocks_used == 0, "blocks leaked"
    return rows


def report(shape: ModelShape, rows: list[dict], dtype_bytes: int) -> list[str]:
    cap = math.ceil((shape.sliding_window - 1) / BLOCK_SIZE) + 1 if shape.sliding_window else None
    lines = [f"{shape.name}: {shape.num_global_layers} global + {shape.num_window_layers} window layers"
             + (f" (w = {shape.sliding_window:,}; a window group holds at most ceil((w-1)/16)+1 = {cap} blocks "
                "between decodes)" if cap else ""),
             f"{'tokens':>8} {'global MiB':>11} {'window MiB':>11} {'total MiB':>10} {'all global MiB':>15} "
             f"{'window group blocks':>20}"]
    by_tokens = {row["tokens"]: row for row in rows}
    checkpoints = sorted({2**k for k in range(4, 40) if rows[0]["tokens"] <= 2**k <= rows[-1]["tokens"]}
                         | {rows[0]["tokens"], rows[-1]["tokens"]})
    unwindowed = shape.as_global()
    for tokens in checkpoints:
        row = by_tokens.get(tokens) or min(rows, key=lambda r: abs(r["tokens"] - tokens))
        total = row["global_bytes"] + row["window_bytes"]
        all_global = unwindowed.layer_bytes_per_token(dtype_bytes) * shape.num_layers * math.ceil(row["tokens"] / BLOCK_SIZE) * BLOCK_SIZE
        lines.append(f"{row['tokens']:>8,} {row['global_bytes'] / 2**20:>11,.1f} {row['window_bytes'] / 2**20:>11,.1f} "
                     f"{total / 2**20:>10,.1f} {all_global / 2**20:>15,.1f} {row['window_group_blocks']:>20}")
    decoding = [row["window_group_blocks"] for row in rows
                if row["decoding"] and shape.sliding_window and row["tokens"] >= shape.sliding_window]
    if cap and decoding:
        lines.append(f"window group blocks while decoding from the first window on: max {max(decoding)} (cap {cap}); "
                     f"a prefill chunk of n tokens holds up to ceil((w + n - 2) / 16) + 1")
    return lines


def plot(results: dict[str, list[dict]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)")
        return
    figure, axis = plt.subplots(figsize=(8, 5))
    for name, rows in results.items():
        tokens = [row["tokens"] for row in rows]
        axis.plot(tokens, [row["global_bytes"] / 2**20 for row in rows], label=f"{name}: global layers")
        axis.plot(tokens, [row["window_bytes"] / 2**20 for row in rows], linestyle="--", label=f"{name}: window layers")
    axis.set_xlabel("context length (tokens)")
    axis.set_ylabel("KV held by one request (MiB)")
    axis.set_title("KV cache per request: global vs sliding-window layers")
    axis.legend(fontsize="small")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mistral-7b-v0.1", "gemma-3-4b"], choices=sorted(PRESETS))
    parser.add_argument("--window", type=int, default=1024, help="also a synthetic model of 1 global + 7 window layers "
                        "of this window (0: none)")
    parser.add_argument("--max-tokens", type=int, default=10240)
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (the rest is decoded)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (the scheduler's token budget)")
    parser.add_argument("--kv-dtype-bytes", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    shapes = [PRESETS[name] for name in args.models]
    if args.window:
        shapes.append(ModelShape(f"window-{args.window}", num_layers=8, num_heads=8, num_kv_heads=8, head_dim=128,
                                 sliding_window=args.window, num_window_layers=7))
    results = {}
    for shape in shapes:
        rows = measure(shape, args.max_tokens, args.prompt_len, args.chunk, args.kv_dtype_bytes)
        results[shape.name] = rows
        print("\n".join(report(shape, rows, args.kv_dtype_bytes)), end="\n\n")
    if args.json:
        args.json.write_text(json.dumps(results))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
