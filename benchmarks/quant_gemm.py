"""kvserve's VNNI int4 / int8 matmuls (kernels/cpu_quant_gemm.py) against torch's CPU ops.

    python benchmarks/quant_gemm.py [--rows 1,2,4,8,16,64] [--repeats 50]

On SmolLM2's weight shapes (fused qkv, o, gate_up, down, and lm_head at int4 for reference),
the same groups-of-32 weights run through torch's `_weight_int4pack_mm_for_cpu` and kvserve's
int4 kernel, and the int8 output layer (the int4 mode's, per-channel scales) through torch's
`_weight_int8pack_mm` and kvserve's int8 kernel, interleaved in one process (A, B, A, B, ...),
each keeping its minimum: per matmul microseconds, the ratio, the bytes kvserve's reads and its
effective GB/s, and the sum over one forward's 30 layers. Also prints each op's largest error
against the float product of the dequantized weights (kvserve's also quantize activations).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.engine.quantization.int4_linear import quantize_int4
from kvserve.engine.quantization.int8_linear import quantize_int8
from kvserve.kernels.cpu_quant_gemm import int4_gemm, int8_gemm, pack_int4, pack_int8, quant_gemm_available

SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("lm_head", 49152, 576, 1), ("lm_head8", 49152, 576, 1)]  # lm_head8: int8, as the int4 mode runs it


def _min_us(fns: dict[str, object], repeats: int) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - started)
    return {name: seconds * 1e6 for name, seconds in best.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    if not quant_gemm_available():
        parser.exit(1, "the int4 VNNI kernel is unavailable here (see the log line above)\n")
    torch.manual_seed(0)
    weights = {}
    for name, n, k, _ in SHAPES:
        w = torch.randn(n, k) * 0.05
        if name == "lm_head8":
            q8, scale8 = quantize_int8(w)
            weights[name] = (pack_int8(q8, scale8), q8, scale8.to(torch.bfloat16), q8.float() * scale8[:, None])
            continue
        q, scale, zero = quantize_int4(w)
        minimum = zero - 8 * scale
        packed = pack_int4(q, scale, minimum)
        torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.stack([scale.t(), zero.t()], -1).contiguous().to(torch.bfloat16)
        reference = (q.float().reshape(n, -1, 32) * scale[..., None] + minimum[..., None]).reshape(n, k)
        weights[name] = (packed, torch_packed, sz, reference)
    for rows in [int(r) for r in args.rows.split(",")]:
        print(f"\nrows={rows} threads={torch.get_num_threads()}")
        print(f"{'shape':8} {'N x K':>11} {'torch us':>9} {'vnni us':>8} {'ratio':>6} {'MB':>6} {'GB/s':>6} "
              f"{'err torch':>9} {'err vnni':>9}")
        total = {"torch": 0.0, "vnni": 0.0}
        for name, n, k, count in SHAPES:
            packed, torch_packed, sz, reference = weights[name]
            x = torch.randn(rows, k).to(torch.bfloat16)
            if name == "lm_head8":
                fns = {"torch": lambda: torch.ops.aten._weight_int8pack_mm(x, torch_packed, sz),
                       "vnni": lambda: int8_gemm(x, packed)}
            else:
                fns = {"torch": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch_packed, 32, sz),
                       "vnni": lambda: int4_gemm(x, packed)}
            us = _min_us(fns, args.repeats)
            exact = x.float() @ reference.t()
            scale = exact.abs().max().item()
            err = {key: ((fn().float() - exact).abs().max().item() / scale) for key, fn in fns.items()}
            mb = packed.numel() / 1e6
            print(f"{name:8} {n:>5}x{k:<5} {us['torch']:9.1f} {us['vnni']:8.1f} {us['torch'] / us['vnni']:6.2f} "
                  f"{mb:6.2f} {mb * 1e3 / us['vnni']:6.1f} {err['torch']:9.2e} {err['vnni']:9.2e}")
            if not name.startswith("lm_head"):
                for key in total:
                    total[key] += us[key] * count
        print(f"30 layers: torch {total['torch'] / 1e3:.2f} ms, vnni {total['vnni'] / 1e3:.2f} ms "
              f"({total['torch'] / total['vnni']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
