"""Single-stream decode, --quantization int4, against llama.cpp on the same Q4_1 GGUF, alternating.

    python benchmarks/int4_single_stream.py [--llama-bench PATH] [--gguf PATH] [--rounds 5] [--tokens 64]

Each round runs, one after another: kvserve int4 with its VNNI kernels (the default where the CPU
has them), kvserve int4 on torch's `_weight_int4pack_mm_for_cpu` and, for the int8 output layer,
`_weight_int8pack_mm` (the path before those kernels), and
`llama-bench -m GGUF -n TOKENS -p 0 -t THREADS` (llama.cpp's own decode benchmark; omitted without
--llama-bench). kvserve's figure is ms per output token of one greedy stream through LLM.generate:
the difference between a (TOKENS + 1)-token and a 1-token generation of the same 64-token prompt,
over TOKENS. Prints every round and the median of the per-round ratios, which load from other
processes moves far less than the absolute figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bf16_gemm import decode_ms_per_token  # noqa: E402
from peers import peers_dir  # noqa: E402
from run_all import DEFAULT_GGUF  # noqa: E402

from kvserve.engine import LLM  # noqa: E402
from kvserve.engine.quantization import quantize_model  # noqa: E402
from kvserve.engine.worker import model_preparation  # noqa: E402

KERNELS = {"int4 vnni": "vnni", "int4 torch op": "torch"}  # quantize_model's kernel


def kvserve_llm(kernel: str, gguf: Path) -> LLM:
    with mock.patch.object(model_preparation, "quantize_model", functools.partial(quantize_model, kernel=kernel)):
        return LLM(model=str(gguf), dtype="bfloat16", quantization="int4", enable_prefix_caching=False,
                   num_kv_blocks=64, max_model_len=512)


def kvserve_ms_per_token(llm: LLM, tokens: int) -> float:
    return decode_ms_per_token(llm, tokens, prompt_len=64)


def llama_ms_per_token(binary: Path, gguf: Path, tokens: int, threads: int) -> float:
    result = subprocess.run([str(binary), "-m", str(gguf), "-n", str(tokens), "-p", "0", "-t", str(threads),
                             "-r", "1", "-o", "json"], capture_output=True, text=True, check=True, timeout=600)
    return 1e3 / json.loads(result.stdout)[0]["avg_ts"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_bench = peers_dir() / "llama_cpp_python-0.3.36" / "build" / "bin" / "llama-bench"
    parser.add_argument("--llama-bench", type=Path, default=default_bench if default_bench.exists() else None)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    llms = {label: kvserve_llm(kernel, args.gguf) for label, kernel in KERNELS.items()}
    for llm in llms.values():  # warm: compiled graphs, caches
        kvserve_ms_per_token(llm, 4)
    rounds = []
    for round_number in range(args.rounds):
        figures = {label: kvserve_ms_per_token(llm, args.tokens) for label, llm in llms.items()}
        if args.llama_bench:
            figures["llama.cpp Q4_1"] = llama_ms_per_token(args.llama_bench, args.gguf, args.tokens, threads)
        rounds.append(figures)
        print(f"round {round_number + 1}: " + ", ".join(f"{k} {v:.2f} ms/token" for k, v in figures.items()), flush=True)
    print(f"\nmedian of per-round ratios ({args.rounds} rounds, {threads} threads, {args.tokens} tokens):")
    baselines = ["int4 torch op"] + (["llama.cpp Q4_1"] if args.llama_bench else [])
    for baseline in baselines:
        ratio = statistics.median(r["int4 vnni"] / r[baseline] for r in rounds)
        print(f"  int4 vnni / {baseline}: {ratio:.2f}x")
    if args.llama_bench:
        ratio = statistics.median(r["int4 torch op"] / r["llama.cpp Q4_1"] for r in rounds)
        print(f"  int4 torch op / llama.cpp Q4_1: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
