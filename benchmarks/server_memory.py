"""Where a serving process's memory goes over many mixed requests, per environment variant.

Starts `kvserve serve` (the default model unless --model) on a free port on 127.0.0.1 once per
variant, sends a warm-up of mixed requests, then ROUNDS x REQUESTS more (streams, n=2, stop
strings, chat, early disconnects, prompts of 1-400 tokens, so the engine meets many step
shapes), and prints RSS after the warm-up and after each round, with a breakdown of the growth
from /proc/PID/smaps (heap, anonymous mappings, executable anonymous = JIT code, files):

    python benchmarks/server_memory.py                               # default vs the caches capped at 0
    python benchmarks/server_memory.py --variants "default;ONEDNN_PRIMITIVE_CACHE_CAPACITY=128,LRU_CACHE_CAPACITY=128"
    python benchmarks/server_memory.py --requests 200 --rounds 1 --warmup 20   # a smoke run

A variant is 'default' (kvserve's own settings) or NAME=VALUE[,NAME=VALUE] set in the server's
environment; '--serve-args' are passed to every server. Throughput (requests/s) is printed too,
but it is a load figure, not a benchmark: compare speed with benchmarks/onednn_cache.py --engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CONCURRENCY = 16
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY", "MALLOC_ARENA_MAX")
WORDS = "the of and a to in is you that it he was for on are as with his they I at be this have from".split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def memory_mib(pid: int) -> dict[str, float]:
    """RSS by kind of mapping, from /proc/PID/smaps."""
    kinds = {"rss": 0.0, "heap": 0.0, "anon": 0.0, "anon_exec": 0.0, "file": 0.0}
    kind = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        match = re.match(r"^[0-9a-f]+-[0-9a-f]+ (\S+) \S+ \S+ \S+\s*(.*)$", line)
        if match:
            perms, name = match.groups()
            if name == "[heap]":
                kind = "heap"
            elif name and not name.startswith("["):
                kind = "file"
            else:
                kind = "anon_exec" if "x" in perms else "anon"
        elif line.startswith("Rss:"):
            kib = int(line.split()[1]) / 1024
            kinds[kind] += kib
            kinds["rss"] += kib
    return kinds


async def one_request(client: httpx.AsyncClient, rng: random.Random) -> str:
    kind = rng.choice(["complete", "complete", "stream", "chat", "chat_stream", "n", "stop", "disconnect"])
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice([rng.randint(1, 40), rng.randint(40, 400)])))
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 32), "temperature": rng.choice([0, 0.8])}
    if kind in ("chat", "chat_stream"):
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": body["max_tokens"],
                "stream": kind == "chat_stream"}
        response = await client.post("/v1/chat/completions", json=chat)
    elif kind in ("stream", "disconnect"):
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if kind == "disconnect" and seen >= 2:
                    break
        return kind
    elif kind == "n":
        response = await client.post("/v1/completions", json={**body, "n": 2})
    elif kind == "stop":
        response = await client.post("/v1/completions", json={**body, "stop": ["the", "and a"]})
    else:
        response = await client.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{kind}: {response.status_code} {response.text[:200]}")
    return kind


async def drive(url: str, count: int, seed: int) -> float:
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(CONCURRENCY)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as client:
        async def guarded() -> None:
            async with semaphore:
                await one_request(client, rng)

        await asyncio.gather(*(guarded() for _ in range(count)))
    return count / (time.monotonic() - started)


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become ready")


def growth(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{kind} {after[kind] - before[kind]:+.1f}" for kind in ("heap", "anon", "anon_exec", "file"))


def run_variant(variant: str, args: argparse.Namespace) -> None:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    if variant != "default":
        env.update(item.split("=", 1) for item in variant.split(","))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="kvserve-memory-")) / "server.log"
    argv = ["kvserve", "serve", "--port", str(port), "--log-level", "warning", *shlex.split(args.serve_args)]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(url, process, log)
        start = memory_mib(process.pid)
        asyncio.run(drive(url, args.warmup, seed=0))
        warm = memory_mib(process.pid)
        line = (f"{variant}: RSS {start['rss']:.0f} MiB loaded, {warm['rss']:.0f} after {args.warmup} warm-up "
                f"requests")
        previous = warm
        for round_index in range(args.rounds):
            rate = asyncio.run(drive(url, args.requests, seed=round_index + 1))
            now = memory_mib(process.pid)
            line += (f"; round {round_index + 1} ({args.requests} requests, {rate:.1f} req/s): {now['rss']:.0f} MiB "
                     f"({now['rss'] - previous['rss']:+.1f}: {growth(previous, now)})")
            previous = now
        print(line, flush=True)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="default;ONEDNN_PRIMITIVE_CACHE_CAPACITY=0,LRU_CACHE_CAPACITY=0")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--requests", type=int, default=1500, help="requests per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve-args", default="", help="extra `kvserve serve` arguments, e.g. '--enforce-eager'")
    args = parser.parse_args()
    for variant in args.variants.split(";"):
        run_variant(variant, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
