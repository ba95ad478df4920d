"""Where online throughput goes missing: offline `LLM.generate` and the same requests through
`kvserve serve` over HTTP streaming, interleaved in one run (A, B, A, B, ...), so both see the same
machine load. Prints each round, the best of each, and the CPU seconds each side spent (offline:
this process; online: the client, the server and each server thread), which says what the HTTP
path costs beyond the model steps and whether the load-test client competes for the cores. CPU
seconds hold up on a busy machine better than tokens/s do.

    OMP_NUM_THREADS=2 python benchmarks/online_gap.py --num-requests 64 --rounds 3

The server runs as a subprocess (as in run_all.py's online stage) with the offline run's
settings; the client is kvserve-bench's (loadtest/) in this process, with its one warm-up request.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import KvserveServerOptions, ServerProcess, free_port, kvserve_serve_argv, stream_workload  # noqa: E402
from throughput import run_kvserve_continuous  # noqa: E402
from workload import WorkItem, fixed_workload, kv_blocks  # noqa: E402

from kvserve.engine import LLM, SamplingParams  # noqa: E402


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process and its reaped children (/proc/PID/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of a process, by thread id (the main thread's id is the pid)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[int(task.name)] = process_cpu_s_of(task / "stat")
        except OSError:
            continue
    return times


def process_cpu_s_of(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_online(base_url: str, items: list[WorkItem], warmups: int) -> tuple[int, float, float, float]:
    """(output tokens, measured seconds, mean TTFT s, mean TPOT s) of one kvserve-bench-style run."""
    ok, seconds = stream_workload(base_url, items, warmups=warmups)
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    return (sum(r.output_tokens for r in ok), seconds, sum(r.ttft_s for r in ok) / len(ok),
            sum(tpots) / max(1, len(tpots)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", default="16,256")
    p.add_argument("--output-len", default="16,256")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--server-arg", action="append", default=[], help="extra `kvserve serve` argument (repeatable)")
    args = p.parse_args()
    prompt_len = tuple(int(x) for x in args.prompt_len.split(","))
    output_len = tuple(int(x) for x in args.output_len.split(","))
    items = fixed_workload(args.num_requests, prompt_len, output_len)
    blocks = kv_blocks(items)

    llm = LLM(dtype=args.dtype, max_num_seqs=max(64, len(items)), max_num_batched_tokens=2048,
              enable_prefix_caching=False, max_model_len=1024, num_kv_blocks=blocks)
    llm.generate([items[0].prompt_token_ids], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    port = free_port()
    options = KvserveServerOptions(dtype=args.dtype, max_num_seqs=max(64, len(items)), num_kv_blocks=blocks)
    argv = kvserve_serve_argv(port, options) + args.server_arg
    print("server:", " ".join(argv[1:]), flush=True)
    offline, online = [], []
    server = ServerProcess(argv, port, Path("/tmp") / f"online_gap_server_{port}.log")
    with server as base_url:
        server_pid = server.pid
        for round_ in range(args.rounds):
            cpu0 = own_cpu_s()
            tokens, seconds = run_kvserve_continuous(llm, items)
            offline.append(tokens / seconds)
            print(f"round {round_}: offline {tokens / seconds:7.1f} tok/s ({seconds:.1f} s; CPU s {own_cpu_s() - cpu0:.1f})",
                  flush=True)
            client0, server0, threads0 = own_cpu_s(), process_cpu_s(server_pid), thread_cpu_s(server_pid)
            tokens, seconds, ttft, tpot = run_online(base_url, items, warmups=1)
            client_cpu, server_cpu = own_cpu_s() - client0, process_cpu_s(server_pid) - server0
            threads = {tid: cpu - threads0.get(tid, 0.0) for tid, cpu in thread_cpu_s(server_pid).items()}
            busy = sorted(((cpu, tid) for tid, cpu in threads.items() if cpu >= 0.05), reverse=True)
            print("  server threads (CPU s): " + ", ".join(
                f"{'main/loop' if tid == server_pid else tid} {cpu:.1f}" for cpu, tid in busy), flush=True)
            online.append(tokens / seconds)
            print(f"round {round_}: online  {tokens / seconds:7.1f} tok/s ({seconds:.1f} s, TTFT {ttft * 1e3:.0f} ms, "
                  f"TPOT {tpot * 1e3:.1f} ms; CPU s: client {client_cpu:.1f}, server {server_cpu:.1f})", flush=True)
    print(f"best: offline {max(offline):.1f}, online {max(online):.1f} tok/s = {max(online) / max(offline):.1%} "
          f"of offline", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
