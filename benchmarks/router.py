"""Cache-aware vs round-robin routing over kvserve replicas behind SGLang Model Gateway.

    python benchmarks/router.py                      # 2 replicas, ~5 min on 2 idle cores
    python benchmarks/router.py --replicas 4 --num-prompts 96 --request-rate 4

Starts N `kvserve serve` replicas (prefix caching on) on 127.0.0.1, then, for each policy, a
gateway in front of them and one `kvserve-bench --dataset-name prefix` run (a few long shared
prefixes, Poisson arrivals). Each policy gets fresh prefixes (its own --seed), so neither profits
from the other's cache. Reported per policy: TTFT (mean, median, p99), throughput, and the
prefix-cache hit ratio = hit / looked-up prompt tokens summed over the replicas' /metrics.
Writes router-<policy>.json (kvserve-bench's result) and router-summary.json to --out-dir.
Needs sglang-router (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import ServerProcess, executable, free_port  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PREFIX_COUNTERS = ("kvserve_prefix_cache_queries_total", "kvserve_prefix_cache_hits_total")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policies", default="round_robin,cache_aware")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--request-rate", default="1", help="requests/s (Poisson), or inf")
    parser.add_argument("--prefix-len", type=int, default=400, help="words in each shared prefix")
    parser.add_argument("--num-prefixes", type=int, default=6)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--threads-per-replica", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/kvserve-router-bench"))
    args = parser.parse_args(argv)
    if min(args.replicas, args.num_prompts, args.prefix_len, args.num_prefixes, args.threads_per_replica) < 1:
        parser.error("--replicas, --num-prompts, --prefix-len, --num-prefixes and --threads-per-replica must be >= 1")
    return args


def prefix_counters(replica_url: str) -> dict[str, float]:
    totals = dict.fromkeys(PREFIX_COUNTERS, 0.0)
    for line in httpx.get(f"{replica_url}/metrics", timeout=10, trust_env=False).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def gateway_argv(port: int, worker_urls: Sequence[str], policy: str) -> list[str]:
    return [executable("sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *worker_urls, "--policy", policy, "--health-check-endpoint", "/health",
            "--log-level", "warn"]


def wait_for_workers(gateway_url: str, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(f"{gateway_url}/workers", timeout=5, trust_env=False).json()["workers"]
        if sum(1 for worker in workers if worker["is_healthy"]) == count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the gateway at {gateway_url} did not list {count} healthy workers in {timeout_s} s")


def bench(args: argparse.Namespace, gateway_url: str, policy: str, seed: int) -> dict[str, Any]:
    filename = f"router-{policy}.json"
    argv = [executable("kvserve-bench"), "--base-url", gateway_url, "--model", MODEL,
            "--dataset-name", "prefix", "--prefix-len", str(args.prefix_len),
            "--prefix-suffix-len", str(args.suffix_len), "--prefix-output-len", str(args.output_len),
            "--prefix-num-prefixes", str(args.num_prefixes), "--num-prompts", str(args.num_prompts),
            "--request-rate", args.request_rate, "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
            "--save-result", "--result-dir", str(args.out_dir), "--result-filename", filename]
    subprocess.run(argv, check=True, timeout=1800)
    return json.loads((args.out_dir / filename).read_text())


def run_policy(args: argparse.Namespace, replica_urls: list[str], policy: str, seed: int) -> dict[str, Any]:
    port = free_port()
    log = args.out_dir / "logs" / f"gateway-{policy}.log"
    with ServerProcess(gateway_argv(port, replica_urls, policy), port, log, startup_timeout_s=60) as gateway_url:
        wait_for_workers(gateway_url, len(replica_urls))
        before = [prefix_counters(url) for url in replica_urls]
        result = bench(args, gateway_url, policy, seed)
        after = [prefix_counters(url) for url in replica_urls]
    looked_up, hit = (sum(a[name] - b[name] for a, b in zip(after, before)) for name in PREFIX_COUNTERS)
    return {
        "policy": policy,
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "mean_ttft_ms": result.get("mean_ttft_ms"),
        "median_ttft_ms": result.get("median_ttft_ms"),
        "p99_ttft_ms": result.get("p99_ttft_ms"),
        "prefix_cache_hit_ratio": hit / looked_up if looked_up else 0.0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_replica))
    rows = []
    with ExitStack() as stack:
        replica_urls = []
        for index in range(args.replicas):
            port = free_port()
            replica_argv = [executable("kvserve"), "serve", "--host", "127.0.0.1", "--port", str(port),
                            "--num-kv-blocks", str(args.num_kv_blocks), "--log-level", "warning"]
            log = args.out_dir / "logs" / f"kvserve-{index}.log"
            replica_urls.append(stack.enter_context(ServerProcess(replica_argv, port, log, env=env)))
        for seed, policy in enumerate(args.policies.split(","), start=1):
            rows.append(run_policy(args, replica_urls, policy, seed))
    summary = {"replicas": args.replicas, "request_rate": args.request_rate, "num_prompts": args.num_prompts,
               "prefix_len_words": args.prefix_len, "num_prefixes": args.num_prefixes, "policies": rows}
    (args.out_dir / "router-summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{args.replicas} replicas, {args.num_prompts} requests at {args.request_rate}/s, "
          f"{args.num_prefixes} prefixes of {args.prefix_len} words\n")
    print("| policy | completed | failed | req/s | TTFT mean ms | TTFT median ms | TTFT p99 ms | prefix hit ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['policy']} | {row['completed']} | {row['failed']} | {row['request_throughput']:.2f} | "
              f"{row['mean_ttft_ms']:.0f} | {row['median_ttft_ms']:.0f} | {row['p99_ttft_ms']:.0f} | "
              f"{row['prefix_cache_hit_ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
