"""The container image against bare metal, on one machine: its size, its cold and warm start, and
the workload through both side by side.

    python benchmarks/image_bench.py --image kvserve:cpu --out /tmp/image-bench      # ~10 min
    python benchmarks/image_bench.py --image kvserve:cpu --num-prompts 4 --streams 4 --output-len 4,12   # smoke

- size: `docker image inspect`;
- first start: a fresh container until GET /health is 200, and the compile time and inductor
  cache hits/misses its log reports (hits: the image's build-time cache served this CPU and
  thread count; misses: the forward compiled);
- warm start: `docker restart` of that container, whose writable layer keeps the compile caches
  (as a volume at $KVSERVE_CACHE would across containers);
- throughput: a host `kvserve serve` and the container with the same flags and threads, both
  running, driven by kvserve-bench with the first --num-prompts requests of the workload at
  --streams concurrent streams, alternating host, image, host, image (target: the image within
  10% of the host).
Writes image_bench.json and the runs' kvserve-bench JSON into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_stages import Server, online_runs  # noqa: E402
from serving import KvserveServerOptions, ServerProcess, free_port, kvserve_serve_argv, write_workload_jsonl  # noqa: E402
from stages import display_command  # noqa: E402
from workload import fixed_workload  # noqa: E402

COMPILED = re.compile(r"forward compiled in ([\d.]+) s \(inductor's graph cache: (\d+) hits, (\d+) misses\)")


def docker(*args: str, timeout: float = 120) -> str:
    """The command's stdout, and its stderr after it (`docker logs` gives the server's log there)."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed: {done.stderr.strip()[-1000:]}")
    return done.stdout + done.stderr


def wait_healthy(url: str, timeout_s: float, container: str) -> float:
    """Seconds until GET /health answers 200 (from the call), or an error with the log's end."""
    started = time.monotonic()
    with httpx.Client(timeout=2.0, trust_env=False) as http:
        while time.monotonic() - started < timeout_s:
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            state = json.loads(docker("inspect", container))[0]["State"]
            if not state["Running"]:
                raise RuntimeError(f"the container exited ({state['ExitCode']}): {docker('logs', container)[-2000:]}")
            time.sleep(0.5)
    raise RuntimeError(f"not healthy within {timeout_s:.0f} s")


def compile_line(logs: str) -> dict | None:
    """The last start's compile time and inductor cache hits/misses, from the server's log."""
    found = COMPILED.findall(logs)
    if not found:
        return None
    seconds, hits, misses = found[-1]
    return {"seconds": float(seconds), "cache_hits": int(hits), "cache_misses": int(misses)}


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/image-bench"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-len", type=_pair, default=(16, 256), help="LOW,HIGH tokens (the workload's)")
    parser.add_argument("--output-len", type=_pair, default=(16, 256), help="LOW,HIGH tokens (the workload's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--startup-timeout", type=float, default=600)
    args = parser.parse_args()
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    items = fixed_workload(num_requests=args.num_prompts, prompt_len=args.prompt_len, output_len=args.output_len)
    dataset = write_workload_jsonl(items, out / "workload.jsonl")
    options = KvserveServerOptions(max_num_seqs=max(64, args.streams))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    result: dict = {"image": args.image, "threads": args.threads,
                    "size_bytes": int(docker("image", "inspect", "--format", "{{.Size}}", args.image).strip())}
    print(f"{args.image}: {result['size_bytes'] / 1e9:.2f} GB", flush=True)

    name = f"kvserve-bench-{uuid.uuid4().hex[:8]}"
    image_port, host_port = free_port(), free_port()
    # The image's entrypoint is `kvserve serve`. Its log at info level carries the line that says
    # whether the forward compiled and what inductor's cache served (the benchmarks' servers log
    # warnings only; the later --log-level wins).
    container_args = [*kvserve_serve_argv(image_port, options)[2:], "--log-level", "info"]
    try:
        started = time.monotonic()
        docker("run", "-d", "--name", name, "--network", "host", "-e", f"OMP_NUM_THREADS={args.threads}", args.image,
               *container_args)
        result["cold_start_s"] = time.monotonic() - started + wait_healthy(f"http://127.0.0.1:{image_port}",
                                                                         args.startup_timeout, name)
        result["cold_compile"] = compile_line(docker("logs", name))
        print(f"cold start: healthy in {result['cold_start_s']:.1f} s (compile: {result['cold_compile']})", flush=True)
        started = time.monotonic()
        docker("restart", "-t", "30", name, timeout=180)
        result["warm_start_s"] = time.monotonic() - started + wait_healthy(f"http://127.0.0.1:{image_port}",
                                                                         args.startup_timeout, name)
        result["warm_compile"] = compile_line(docker("logs", name))
        print(f"warm start (docker restart): healthy in {result['warm_start_s']:.1f} s (compile: "
              f"{result['warm_compile']})", flush=True)
        host_argv = kvserve_serve_argv(host_port, options)
        with ServerProcess(host_argv, host_port, out / "logs" / "host-server.log", args.startup_timeout, env=env) as url:
            servers = [Server("kvserve", "kvserve serve (bare metal)", display_command(host_argv), url),
                       Server("kvserve-image", f"{args.image} (container)", f"docker run {args.image} ...",
                              f"http://127.0.0.1:{image_port}")]
            _, runs = online_runs(servers, dataset, (args.streams,), {args.streams: args.num_prompts}, args.repeats,
                                  out, 900)
        result["container_log_tail"] = docker("logs", name)[-3000:]
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
    result["runs"] = [{"system": r["system"], "round": r["round"], "output_throughput": r["result"]["output_throughput"],
                       "median_tpot_ms": r["result"]["median_tpot_ms"]} for r in runs]
    medians = {s: statistics.median(r["output_throughput"] for r in result["runs"] if r["system"] == s)
               for s in {r["system"] for r in result["runs"]}}
    result["median_output_throughput"] = medians
    (out / "image_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    for run in result["runs"]:
        print(f"  round {run['round']}: {run['system']}: {run['output_throughput']:.1f} output tok/s, "
              f"TPOT p50 {run['median_tpot_ms']:.1f} ms")
    if len(medians) == 2:
        host, image = (medians[s.system] for s in servers)
        print(f"image / host output tok/s (medians): {image / host:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
