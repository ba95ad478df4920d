"""Which weight-only quantized matmul is fastest on this CPU? Measured before choosing one.

    python benchmarks/quant_variants.py [--rows 1,64] [--repeats 30] [--threads 1,2] [--compiled]

On SmolLM2's weight shapes (fused qkv, o, gate_up, down, lm_head), for each row count: bf16
`F.linear` (the baseline), torch's `_weight_int8pack_mm` (int8, one scale per output channel),
torch's `_weight_int4pack_mm_for_cpu` (int4, groups of 32 or 64 along K), and with --compiled the
dequantize-then-matmul graphs torch.compile (inductor) builds for int8 and int4. Variants are
interleaved (A, B, C, A, B, C, ...) in one process and each keeps its minimum, so that load from
other processes hits them all alike; with --threads, each thread count is one more interleaved
variant (torch.set_num_threads between them), which shows whether an op uses the second core.
Prints one table per row count (and thread count): milliseconds per matmul and the sum over one
whole forward (30 layers + lm_head), i.e. what one decode step pays. The forward sums put every
variant at lm_head too; kvserve's int4 mode keeps lm_head at int8 (engine/quantization).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (name, out_features N, in_features K, times per forward)
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("lm_head", 49152, 576, 1)]


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(1).clamp(min=1e-8) / 127
    return (w.float() / scale[:, None]).round().clamp(-128, 127).to(torch.int8), scale.to(w.dtype)


def int4_weights(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 [N, K/2] nibbles for the compiled variant, packed for torch's op, scales+zeros [K/g, N, 2])."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale  # torch's op dequantizes (q - 8) * scale + zero
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return nibbles, packed, torch.stack([scale.t(), zero.t()], -1).contiguous().to(w.dtype)


def dequant_int8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w8.to(x.dtype)) * scale


def dequant_int4_linear(x: torch.Tensor, nibbles: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    n = nibbles.shape[0]
    q = torch.stack([nibbles & 15, nibbles >> 4], -1).view(n, -1, group)
    scale = sz[..., 0].t()[..., None]
    bias = sz[..., 1].t()[..., None] - 8 * scale  # (q - 8) * scale + zero = q * scale + bias
    return F.linear(x, torch.addcmul(bias, q, scale).reshape(n, -1))


def variants(n: int, k: int, rows: int, compiled: bool) -> dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w8, s8 = int8_weights(w)
    out = {"bf16 F.linear": lambda: F.linear(x, w), "int8 _weight_int8pack_mm": lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8)}
    for group in (32, 64):
        nibbles, packed, sz = int4_weights(w, group)
        out[f"int4 _weight_int4pack_mm_for_cpu g{group}"] = (
            lambda packed=packed, sz=sz, group=group: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz))
        if group == 64:
            out["int4 eager dequant+mm g64"] = lambda nibbles=nibbles, sz=sz: dequant_int4_linear(x, nibbles, sz, 64)
        if compiled and group == 64:
            fn4 = torch.compile(dequant_int4_linear, dynamic=False)
            out["int4 compiled dequant+mm g64"] = lambda nibbles=nibbles, sz=sz: fn4(x, nibbles, sz, 64)
    out["int8 eager dequant+mm"] = lambda: dequant_int8_linear(x, w8, s8)
    if compiled:
        torch._dynamo.config.recompile_limit = 64  # one graph per shape and row count
        fn8 = torch.compile(dequant_int8_linear, dynamic=False)
        out["int8 compiled dequant+mm"] = lambda: fn8(x, w8, s8)
    return out


def measure(fns: dict[str, Callable[[], torch.Tensor]], repeats: int,
            threads: tuple[int, ...]) -> dict[tuple[str, int], float]:
    """Minimum seconds per (variant, thread count), all of them interleaved."""
    best = {(name, t): float("inf") for name in fns for t in threads}
    with torch.inference_mode():
        for fn in fns.values():  # warm-up (and compilation)
            fn()
            fn()
        for _ in range(repeats):
            for t in threads:
                torch.set_num_threads(t)
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    best[name, t] = min(best[name, t], time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", default=str(torch.get_num_threads()),
                        help="comma-separated intra-op thread counts, interleaved (default: torch's)")
    parser.add_argument("--compiled", action="store_true", help="also time torch.compile'd dequantize+matmul")
    args = parser.parse_args()
    threads = tuple(int(t) for t in args.threads.split(","))
    print(f"torch {torch.__version__}, threads {args.threads}, min of {args.repeats} interleaved runs")
    for rows in (int(r) for r in args.rows.split(",")):
        per_shape = {name: measure(variants(n, k, rows, args.compiled), args.repeats, threads)
                     for name, n, k, _ in SHAPES}
        names = list(dict.fromkeys(v for v, _ in next(iter(per_shape.values()))))
        for t in threads:
            totals = {v: sum(per_shape[s][v, t] * times for s, _, _, times in SHAPES) for v in names}
            print(f"\n{rows} row(s), {t} thread(s): ms per matmul; 'forward' = 30 layers + lm_head")
            print("| variant | " + " | ".join(s for s, *_ in SHAPES) + " | forward ms | vs bf16 |")
            print("|---|" + "---|" * (len(SHAPES) + 2))
            for v in names:
                cells = " | ".join(f"{per_shape[s][v, t] * 1e3:.3f}" for s, *_ in SHAPES)
                print(f"| {v} | {cells} | {totals[v] * 1e3:.2f} | {totals[v] / totals['bf16 F.linear']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
