"""`kvserve-bench`: load-test any OpenAI-compatible server. Flags follow `vllm bench serve`.

    kvserve-bench --base-url http://127.0.0.1:8000 --model M --dataset-name random \\
        --random-input-len 128 --random-output-len 64 --num-prompts 200 --request-rate 4 \\
        --goodput ttft:500 tpot:50 --save-result --result-dir results/
    kvserve-bench ... --request-rate-sweep 1,2,4,inf --result-dir results/   # + PNG plots
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from .arrivals import ArrivalProcess
from .client import Endpoint, EndpointError, discover_model
from .datasets import BenchRequest, DatasetError, PrefixDataset, RandomDataset, SyntheticChatDataset
from .event_loop import run_event_loop
from .goodput import GoodputError, GoodputSLO
from .jsonl_dataset import JsonlDataset
from .metrics import BenchmarkMetrics, compute_metrics
from .records import RunResult
from .report import default_result_filename, format_table, save_result
from .runner import BenchmarkError, LoadConfig, run_load
from .sweep import parse_rates, run_sweep

DATASETS = ("random", "synthetic-chat", "prefix", "jsonl")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve-bench", description=__doc__.split("\n\n")[0])
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://host:8000")
    target.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    target.add_argument("--model", help="model name to request (default: the first one at /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    target.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    target.add_argument("--ignore-eos", action="store_true", help="ask the server to generate every max_tokens")
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request body")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", type=Path, help="JSONL file for --dataset-name jsonl")
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0)
    data.add_argument("--random-prompt-format", choices=("text", "token-ids"), default="text")
    data.add_argument("--random-vocab-size", type=int, default=32000, help="token ids are drawn below this")
    data.add_argument("--chat-input-median", type=int, default=256)
    data.add_argument("--chat-output-median", type=int, default=128)
    data.add_argument("--chat-sigma", type=float, default=1.0, help="log-normal sigma: larger = longer tail")
    data.add_argument("--chat-max-input-len", type=int, default=4096)
    data.add_argument("--chat-max-output-len", type=int, default=1024)
    data.add_argument("--prefix-len", type=int, default=512)
    data.add_argument("--prefix-suffix-len", type=int, default=32)
    data.add_argument("--prefix-output-len", type=int, default=64)
    data.add_argument("--prefix-num-prefixes", type=int, default=1)
    data.add_argument("--jsonl-output-len", type=int, default=128, help="for lines without output_len")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument("--request-rate-sweep", help="comma-separated rates, e.g. 1,2,4,inf; writes plots")
    load.add_argument("--duration", type=float, default=600.0, help="hard cap in seconds on each measured run")
    load.add_argument("--num-warmups", type=int, default=1, help="requests sent and checked before measuring")

    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    out.add_argument("--metric-percentiles", default="90,99", help="comma-separated, e.g. 50,90,99")
    out.add_argument("--save-result", action="store_true", help="write the result as JSON")
    out.add_argument("--save-detailed", action="store_true", help="also store per-request lengths and latencies")
    out.add_argument("--result-dir", type=Path, default=Path("."))
    out.add_argument("--result-filename", help="default: bench-<rate>qps-<model>-<time>.json")
    out.add_argument("--disable-tqdm", action="store_true")
    return p


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.num_prompts < 1:
        raise DatasetError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "jsonl":
        if args.dataset_path is None:
            raise DatasetError("--dataset-name jsonl needs --dataset-path FILE.jsonl")
        return JsonlDataset(args.dataset_path, args.jsonl_output_len).sample(args.num_prompts, args.seed)
    if args.dataset_name == "synthetic-chat":
        dataset = SyntheticChatDataset(args.chat_input_median, args.chat_output_median, args.chat_sigma,
                                       args.chat_max_input_len, args.chat_max_output_len)
    elif args.dataset_name == "prefix":
        dataset = PrefixDataset(args.prefix_len, args.prefix_suffix_len, args.prefix_output_len, args.prefix_num_prefixes)
    else:
        dataset = RandomDataset(args.random_input_len, args.random_output_len, args.random_range_ratio,
                                args.random_prefix_len, args.random_prompt_format == "token-ids", args.random_vocab_size)
    return dataset.sample(args.num_prompts, args.seed)


def run_info(args: argparse.Namespace, endpoint: Endpoint, request_rate: float) -> dict[str, Any]:
    """The settings that produced a result, stored next to it (vLLM's names where they exist)."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if endpoint.is_chat else "openai",
        "base_url": args.base_url,
        "endpoint": endpoint.path,
        "model_id": endpoint.model,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "duration_cap_s": args.duration,
    }


def detailed(run: RunResult) -> dict[str, Any]:
    ok = [r for r in run.records if r.success]
    return {
        "input_lens": [r.prompt_len for r in ok],
        "output_lens": [r.output_tokens for r in ok],
        "ttfts": [r.ttft_s for r in ok],
        "itls": [list(r.itl_s) for r in ok],
        "e2els": [r.e2e_s for r in ok],
        "errors": [f"{r.error_type}: {r.error_message}" for r in run.records if not r.success],
    }


def _result_path(args: argparse.Namespace, model: str, label: str) -> Path:
    return args.result_dir / (args.result_filename or default_result_filename(label, model))


async def _resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as http:
        return await discover_model(http, args.base_url, args.api_key)


async def amain(args: argparse.Namespace) -> int:
    if not isinstance(args.extra_body, dict):
        raise EndpointError("--extra-body must be a JSON object, e.g. '{\"top_k\": 1}'")
    model = await _resolve_model(args)
    endpoint = Endpoint(base_url=args.base_url, model=model, path=args.endpoint, api_key=args.api_key,
                        ignore_eos=args.ignore_eos, request_timeout_s=args.request_timeout,
                        temperature=args.temperature, extra_body=args.extra_body)
    requests = build_requests(args)
    slo = GoodputSLO.parse(args.goodput) if args.goodput else None
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    load = LoadConfig(arrivals=ArrivalProcess(args.request_rate, args.burstiness), max_concurrency=args.max_concurrency,
                      duration_s=args.duration, num_warmups=args.num_warmups, seed=args.seed,
                      show_progress=not args.disable_tqdm)

    if args.request_rate_sweep:
        points = await run_sweep(endpoint, requests, load, parse_rates(args.request_rate_sweep), slo, percentiles)
        results = []
        for point in points:
            print(format_table(point.metrics, f"rate {point.request_rate:g} req/s"))
            results.append({**run_info(args, endpoint, point.request_rate), **point.metrics.to_dict()})
        path = save_result({"sweep": results}, _result_path(args, model, "sweep"))
        from .plots import plot_sweep  # matplotlib only when plotting

        pngs = plot_sweep(points, args.result_dir, stem=path.stem)
        print(f"saved {path} and {', '.join(str(p) for p in pngs)}")
        return 0 if any(p.metrics.completed for p in points) else 1

    run = await run_load(endpoint, requests, load)
    metrics: BenchmarkMetrics = compute_metrics(run, slo, percentiles)
    print(format_table(metrics))
    if args.save_result or args.save_detailed:
        result = {**run_info(args, endpoint, args.request_rate), **metrics.to_dict()}
        if args.save_detailed:
            result.update(detailed(run))
        path = save_result(result, _result_path(args, model, f"bench-{args.request_rate:g}qps"))
        print(f"saved {path}")
    return 0 if metrics.completed else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_event_loop(amain(args))
    except (DatasetError, EndpointError, GoodputError, BenchmarkError, ValueError) as e:
        print(f"kvserve-bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvserve-bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
