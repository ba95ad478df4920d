"""Paired A/B of kvserve's offline throughput under two process environments (an allocator or an
OpenMP runtime preloaded, thread binding, ...): offline.py in alternating processes, A B B A A B ...,
so that a drifting machine hits both alike; prints every run and the median of the paired B/A ratios.

    python benchmarks/offline_ab.py --b LD_PRELOAD=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
        [--a NAME=VALUE ...] [--rounds 3] [--num-requests 64] [-- extra offline.py arguments]

Each --a / --b is NAME=VALUE (repeatable) on top of this process's environment; an empty VALUE
removes NAME. The runs use offline.py's kvserve system without static batches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

OFFLINE = Path(__file__).resolve().parent / "offline.py"


def environment(assignments: Sequence[str], base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    for assignment in assignments:
        name, sep, value = assignment.partition("=")
        if not sep or not name:
            raise SystemExit(f"expected NAME=VALUE, got {assignment!r}")
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    return env


def run_once(env: dict[str, str], num_requests: int, extra: Sequence[str], timeout: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offline.json"
        subprocess.run([sys.executable, str(OFFLINE), "--system", "kvserve", "--batch-sizes", "",
                        "--num-requests", str(num_requests), "--out", str(out), *extra],
                       env=env, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["rows"][0]["tokens_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--b", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("extra", nargs="*", help="after --: more offline.py arguments")
    args = parser.parse_args()
    envs = {"A": environment(args.a, dict(os.environ)), "B": environment(args.b, dict(os.environ))}
    results: dict[str, list[float]] = {"A": [], "B": []}
    for round_ in range(args.rounds):
        for name in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
            results[name].append(run_once(envs[name], args.num_requests, args.extra, args.timeout))
            print(f"round {round_} {name}: {results[name][-1]:.1f} tokens/s", flush=True)
    ratios = [b / a for a, b in zip(results["A"], results["B"])]
    print(f"A {' '.join(args.a) or '(as is)'}: {[round(v, 1) for v in results['A']]}")
    print(f"B {' '.join(args.b) or '(as is)'}: {[round(v, 1) for v in results['B']]}")
    print(f"paired B/A: {[round(r, 3) for r in ratios]}, median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
