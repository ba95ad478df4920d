"""Greedy sampling's lm_head, two ways, alternating in one process: the bf16 logits then their
argmax (bf16_linear, then bf16_row_argmax, what the sampler does) against the argmax taken inside
the kernel (bf16_linear_argmax: the logits are never written, what a plain greedy step does).

    python benchmarks/greedy_head.py [--rows 8,16,32,48,64] [--repeats 5] [--stream-mb 300]

SmolLM2-135M's lm_head (49,152 x 576, bf16), random weights, enough separate copies (>= --stream-mb)
that each call streams its weights from memory as in a decode step. Prints the minimum over
--repeats of the milliseconds per call, and their ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.kernels.cpu_bf16_gemm import bf16_gemm_available, bf16_linear, bf16_linear_argmax, bf16_row_argmax, pack_bf16

VOCAB, HIDDEN = 49152, 576


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,16,32,48,64", help="comma-separated rows per call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream-mb", type=float, default=300.0, help="weight bytes per timed pass")
    args = parser.parse_args()
    if not bf16_gemm_available():
        raise SystemExit("kvserve's bf16 kernel is not available here (needs AVX-512 and a C++ compiler)")
    generator = torch.Generator().manual_seed(0)
    copies = max(1, round(args.stream_mb * 2**20 / (VOCAB * HIDDEN * 2)))
    weights = [pack_bf16(torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16)) for _ in range(copies)]
    ways = {
        "logits + argmax": lambda x, w: bf16_row_argmax(bf16_linear(x, w, None, VOCAB)),
        "argmax in the kernel": lambda x, w: bf16_linear_argmax(x, w, VOCAB),
    }
    print(f"lm_head {VOCAB} x {HIDDEN} bf16, {torch.get_num_threads()} threads, {copies} weight copies; "
          f"ms per call (min of {args.repeats})")
    print("| rows | " + " | ".join(ways) + " | ratio |\n|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN, generator=generator).to(torch.bfloat16)
        best = {name: float("inf") for name in ways}
        for _ in range(args.repeats):
            for name, way in ways.items():
                start = time.perf_counter()
                for w in weights:
                    way(x, w)
                best[name] = min(best[name], (time.perf_counter() - start) / copies * 1e3)
        first, second = best.values()
        print(f"| {rows} | {first:.3f} | {second:.3f} | {first / second:.2f}x |")


if __name__ == "__main__":
    main()
