"""One system's offline throughput on the fixed workload, written as JSON (run_all.py runs each
system in its own process, under its own time limit).

    python benchmarks/offline.py --system kvserve --out results/offline-kvserve.json
    python benchmarks/offline.py --system transformers-static --batch-sizes 8,16,32 --out ...
    python benchmarks/offline.py --system transformers-continuous --out ...

kvserve and transformers `generate` reuse benchmarks/throughput.py's functions. Every system gets
the same dtype (kvserve's "auto" choice for this device), greedy decoding, EOS ignored, and no
prefix caching: the workload shares no prefixes, and the static runs repeat the continuous run's
prompts, which a prefix cache would turn into free prefill.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_stages import speculative_json  # noqa: E402
from throughput import run_kvserve_continuous, run_kvserve_static, run_transformers_static  # noqa: E402
from workload import WorkItem, fixed_workload, kv_blocks  # noqa: E402

from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine.config import EngineConfig  # noqa: E402
from kvserve.engine.device import resolve_device, resolve_dtype  # noqa: E402
from kvserve.engine.model.model_source import resolve_model  # noqa: E402

SYSTEMS = ("kvserve", "transformers-static", "transformers-continuous")
CB_PAGE_SIZE = 256  # transformers' default page size (tokens per KV block)


def row(name: str, output_tokens: int, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"name": name, "output_tokens": output_tokens, "seconds": seconds,
            "tokens_per_s": output_tokens / seconds, **extra}


def bench_kvserve(items: list[WorkItem], dtype: str, static_sizes: Sequence[int],
                  model: str | None = None, device: str = "auto",
                  speculative_config: str | None = None) -> list[dict[str, Any]]:
    # The KV cache is sized to the workload (every request resident at once), not to free memory,
    # so the run does not depend on what else the machine holds.
    blocks = kv_blocks(items)
    llm = LLM(**({"model": model} if model else {}), device=device, dtype=dtype, max_num_seqs=max(64, len(items)),
              max_num_batched_tokens=2048, enable_prefix_caching=False, max_model_len=1024, num_kv_blocks=blocks,
              speculative_config=speculative_config)
    llm.generate([items[0].prompt_token_ids], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    name = "kvserve continuous batching" + (f", speculative {speculative_config}" if speculative_config else "")
    rows = [row(name, *run_kvserve_continuous(llm, items), kind="kvserve-continuous")]
    print(f"kvserve continuous: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    for size in static_sizes:
        rows.append(row(f"kvserve static batches of {size}", *run_kvserve_static(llm, items, size),
                        kind="kvserve-static", batch_size=size))
        print(f"kvserve static {size}: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    return rows


def bench_transformers_static(items: list[WorkItem], dtype: torch.dtype, sizes: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        rows.append(row(f"transformers generate, static batches of {size}", *run_transformers_static(items, size, dtype),
                        kind="transformers-static", batch_size=size))
        print(f"transformers static {size}: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    return rows


def bench_transformers_continuous(items: list[WorkItem], dtype: torch.dtype) -> list[dict[str, Any]]:
    """transformers 5's continuous-batching manager (`init_continuous_batching`): each request with its
    own max_new_tokens, EOS disabled (id -1), KV blocks sized to the workload instead of to free memory."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    source = resolve_model("SmolLM2-135M-Instruct")
    model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, dtype=dtype)
    model.eval()
    blocks = sum(math.ceil((len(i.prompt_token_ids) + i.output_len) / CB_PAGE_SIZE) for i in items) + 8
    cb_config = ContinuousBatchingConfig(page_size=CB_PAGE_SIZE, num_blocks=blocks, max_batch_tokens=2048,
                                         allow_block_sharing=False)
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(i.output_len for i in items), pad_token_id=2,
                                  eos_token_id=None)
    setup_start = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb_config)
    manager.start()
    try:
        # Warm-up, as kvserve gets one: the first step pays one-off allocation costs.
        warm_id = manager.add_request(items[0].prompt_token_ids, max_new_tokens=4, eos_token_id=[-1])
        _collect(manager, [warm_id])
        setup_s = time.perf_counter() - setup_start
        start = time.perf_counter()
        ids = [manager.add_request(i.prompt_token_ids, max_new_tokens=i.output_len, eos_token_id=[-1]) for i in items]
        results = _collect(manager, ids)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    tokens = 0
    for item, request_id in zip(items, ids):
        got = len(results[request_id].generated_tokens)
        if got != item.output_len:
            raise RuntimeError(f"transformers continuous batching returned {got} tokens for a request that asked "
                               f"for {item.output_len} with EOS disabled")
        tokens += got
    print(f"transformers continuous: {tokens / seconds:.1f} tokens/s (setup {setup_s:.1f} s)", flush=True)
    return [row("transformers continuous batching (generate_batch API)", tokens, seconds,
                kind="transformers-continuous", setup_seconds=setup_s)]


def _collect(manager: Any, ids: Sequence[str | None]) -> dict[str, Any]:
    if any(i is None for i in ids):
        raise RuntimeError("transformers' continuous-batching manager refused a request (its queue is closed)")
    wanted, results = set(ids), {}
    while wanted - results.keys():
        result = manager.get_result(timeout=5)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous-batching thread stopped before finishing the workload")
            continue
        if result.error is not None:
            raise RuntimeError(f"transformers continuous batching failed request {result.request_id}: {result.error}")
        if result.is_finished():
            results[result.request_id] = result
    return results


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=_pair, default=(16, 256), help="LOW,HIGH tokens")
    parser.add_argument("--output-len", type=_pair, default=(16, 256), help="LOW,HIGH tokens")
    parser.add_argument("--dtype", default="auto", help="kvserve dtype name; transformers gets the resolved one")
    parser.add_argument("--batch-sizes", default="8,16,32", help="static batch sizes ('' for none)")
    parser.add_argument("--device", default="auto", help="kvserve only: auto, cpu, cuda (benchmarks/gpu_checks.sh)")
    parser.add_argument("--model", help="kvserve only: the model to load (default: the bundled GGUF), e.g. the "
                                        "bf16 Hugging Face folder vLLM loads (benchmarks/peers.py)")
    parser.add_argument("--speculative-config", type=speculative_json,
                        help="kvserve only: vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    args = parser.parse_args(argv)

    items = fixed_workload(num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len)
    config = EngineConfig(dtype=args.dtype, device=args.device)
    dtype = resolve_dtype(config, resolve_device(config))
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    print(f"{args.system}: {len(items)} requests, dtype {dtype}, {torch.get_num_threads()} threads", flush=True)
    if args.system == "kvserve":
        rows = bench_kvserve(items, args.dtype, sizes, args.model, args.device, args.speculative_config)
    elif args.system == "transformers-static":
        rows = bench_transformers_static(items, dtype, sizes)
    else:
        rows = bench_transformers_continuous(items, dtype)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"system": args.system, "dtype": str(dtype).removeprefix("torch."),
                                    "device": str(resolve_device(config)),
                                    "threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
