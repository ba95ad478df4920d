"""kvserve's few-row bf16 kernel against oneDNN's prepacked matmul, interleaved in one process.

    python benchmarks/bf16_gemm.py [--repeats 5] [--rounds 3] [--tokens 128] [--skip-decode]
                                   [--rows 1,2,4,...,256] [--shapes qkv,o,...]

1. Per SmolLM2-135M weight shape (model_shapes.ALL_SHAPES) at 1, 2, 4, ..., 256 rows (--rows; prompt
   chunks, e.g. --rows 128,256,384,528,768,1024,1560,2048, show where each kernel's blocking wins):
   microseconds per matmul and the weights' GB/s (bytes / time) of kvserve_bf16.bf16_linear and of
   mkldnn._linear_pointwise on prepacked weights (what kvserve's bf16 layers ran before), each
   timed over enough separate copies of the matrix (>= --stream-mb) that the weights stream from
   memory as in a decode step, alternating the two per repeat; minimum over --repeats.
2. The single-stream weight-pass floor: one row through all 121 matrices of the model, each its
   own tensor, both kernels alternating (model_shapes.weight_pass_floor_s's yardstick).
3. One-row decode ms/token of the default model in bf16, compiled, through LLM.generate: a
   32-token prompt, --tokens greedy tokens, layers with the few-row kernel (new) and without it
   (oneDNN at every row count: old), alternating for --rounds; the difference between a
   (tokens + 1)- and a 1-token generation, over tokens. Prints the median of per-round ratios,
   which load from other processes moves far less than the absolute figures.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import ALL_SHAPES, WeightShape  # noqa: E402

from kvserve.engine.model.packed_linear import pack_linear_weights, packed_linear  # noqa: E402
from kvserve.kernels.cpu_bf16_gemm import bf16_gemm_available, bf16_linear, pack_bf16  # noqa: E402

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KERNELS = ("kvserve", "oneDNN")
Matmul = Callable[[torch.Tensor], torch.Tensor]


def _matmuls(weight: torch.Tensor) -> dict[str, Matmul]:
    n = weight.shape[0]
    ours, blocked = pack_bf16(weight), torch.ops.mkldnn._reorder_linear_weight(weight)
    return {"kvserve": lambda x: bf16_linear(x, ours, None, n),
            "oneDNN": lambda x: packed_linear(x, blocked, None, n)}


def _weights(shapes: list[WeightShape], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(s.out_features, s.in_features, generator=generator) * 0.02).to(torch.bfloat16)
            for s in shapes]


def _best_alternating(passes: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(passes, float("inf"))
    for name, run in passes.items():  # warm
        run()
    for _ in range(repeats):
        for name, run in passes.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def shape_timings(shape: WeightShape, repeats: int, stream_mb: float,
                  row_counts: tuple[int, ...] = ROW_COUNTS) -> dict[int, dict[str, float]]:
    """rows -> kernel -> seconds per matmul, over copies of the matrix that stream from memory."""
    copies = max(2, int(stream_mb * 1e6 // (shape.out_features * shape.in_features * 2)))
    by_copy = [_matmuls(w) for w in _weights([shape] * copies, seed=shape.out_features)]
    timings = {}
    for rows in row_counts:
        x = torch.randn(rows, shape.in_features).to(torch.bfloat16)

        def run_all(kernel: str) -> None:
            for matmuls in by_copy:
                matmuls[kernel](x)

        best = _best_alternating({k: functools.partial(run_all, k) for k in KERNELS}, repeats)
        timings[rows] = {k: s / copies for k, s in best.items()}
    return timings


def weight_pass_floor(repeats: int) -> dict[str, float]:
    """kernel -> seconds for one row through every weight matrix of the model."""
    shapes = [s for s in ALL_SHAPES for _ in range(s.per_forward)]
    by_matrix = [(w.shape[1], _matmuls(w)) for w in _weights(shapes)]
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in {s.in_features for s in ALL_SHAPES}}

    def run_all(kernel: str) -> None:
        for in_features, matmuls in by_matrix:
            matmuls[kernel](xs[in_features])

    return _best_alternating({k: functools.partial(run_all, k) for k in KERNELS}, repeats)


def decode_llm(few_rows_kernel: bool):
    from kvserve.engine import LLM
    from kvserve.engine.worker import model_preparation

    packing = functools.partial(pack_linear_weights, few_rows_kernel=few_rows_kernel)
    with mock.patch.object(model_preparation, "pack_linear_weights", packing):
        return LLM(dtype="bfloat16", enable_prefix_caching=False, num_kv_blocks=64, max_model_len=512)


def decode_ms_per_token(llm, tokens: int, prompt_len: int = 32) -> float:
    """ms per output token of one greedy stream: a (tokens + 1)-token generation of a prompt
    less a 1-token one, over `tokens` (the prompt's prefill cancels out)."""
    from kvserve.engine import SamplingParams

    prompt = list(range(100, 100 + prompt_len))
    seconds = {}
    for count in (1, tokens + 1):
        params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        seconds[count] = time.perf_counter() - started
    return (seconds[tokens + 1] - seconds[1]) / tokens * 1e3


def _row_counts(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of row counts: {text!r}") from None
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be positive: {text!r}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream-mb", type=float, default=128.0, help="weight bytes per timed pass")
    parser.add_argument("--rounds", type=int, default=3, help="alternating decode rounds")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--shapes", default=",".join(s.name for s in ALL_SHAPES))
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--rows", type=_row_counts, default=ROW_COUNTS, help="comma-separated row counts")
    args = parser.parse_args(argv)
    if not bf16_gemm_available():
        parser.exit(1, "error: kvserve's bf16 kernel is unavailable here (see the log line above)\n")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    print("\n| shape | rows | kvserve us (GB/s) | oneDNN us (GB/s) | oneDNN / kvserve |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for shape in (s for s in ALL_SHAPES if s.name in args.shapes.split(",")):
            nbytes = shape.out_features * shape.in_features * 2
            for rows, best in shape_timings(shape, args.repeats, args.stream_mb, args.rows).items():
                cells = " | ".join(f"{best[k] * 1e6:.1f} ({nbytes / best[k] / 1e9:.1f})" for k in KERNELS)
                print(f"| {shape.name} {shape.out_features}x{shape.in_features} | {rows} | {cells} | "
                      f"{best['oneDNN'] / best['kvserve']:.2f}x |", flush=True)
        floor = weight_pass_floor(args.repeats)
    total = sum(s.out_features * s.in_features * 2 * s.per_forward for s in ALL_SHAPES)
    print(f"\nweight pass, one row through all {total / 1e6:.0f} MB: " + ", ".join(
        f"{k} {floor[k] * 1e3:.2f} ms ({total / floor[k] / 1e9:.1f} GB/s)" for k in KERNELS) +
        f"; oneDNN / kvserve {floor['oneDNN'] / floor['kvserve']:.2f}x", flush=True)
    if args.skip_decode:
        return 0
    llms = {"new (kvserve few-row kernel)": decode_llm(True), "old (oneDNN only)": decode_llm(False)}
    for llm in llms.values():  # warm: compiled graphs, caches
        decode_ms_per_token(llm, 4)
    rounds = []
    for round_number in range(args.rounds):
        figures = {label: decode_ms_per_token(llm, args.tokens) for label, llm in llms.items()}
        rounds.append(figures)
        print(f"round {round_number + 1}: " + ", ".join(f"{k} {v:.2f} ms/token" for k, v in figures.items()), flush=True)
    new, old = llms
    ratio = statistics.median(r[new] / r[old] for r in rounds)
    print(f"\ndecode, one stream, bf16 compiled, {args.tokens} tokens: new / old ms/token, median of "
          f"{args.rounds} rounds: {ratio:.2f}x; per-token floor above: kvserve {floor['kvserve'] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
