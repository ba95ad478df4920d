"""kvserve against the engines users would pick instead, alternated in one run: round r runs every
system once, in the same order (A B A B ...), so a machine whose speed drifts between runs
(±15% here) shifts both sides of a ratio alike.

- offline: kvserve's `LLM.generate` (offline.py) and vLLM's (vllm_offline.py, in vLLM's venv), on
  the same bf16 Hugging Face folder, one process per run;
- online: every running server driven by kvserve-bench with the workload at N concurrent streams
  (`--max-concurrency N`, all requests queued at once);
- single stream: one request at a time, a fixed prompt and output length, ms per output token
  (kvserve-bench's TPOT: the time after the first token over the tokens after it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from serving import BenchRun, bench_argv, write_workload_jsonl
from stages import REPO, StageResult, run_stage
from workload import WorkItem

T = TypeVar("T")
BENCHMARKS = Path(__file__).resolve().parent
KINDS = ("kvserve", "kvserve-int4", "kvserve-image", "vllm", "llama.cpp")


def alternate(systems: Sequence[T], repeats: int) -> list[tuple[int, T]]:
    """(round, system) in the order they run: every system once per round, rounds in turn."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    return [(round_, system) for round_ in range(repeats) for system in systems]


@dataclass(frozen=True)
class Server:
    """A running system under test behind an OpenAI-compatible URL."""

    kind: str  # one of KINDS: what the report compares with what
    system: str  # the report's name for it
    command: str  # its command line, as typed
    base_url: str
    extra_body: str = ""  # JSON merged into every request (llama-server: no prompt cache)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Server.kind must be one of {KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class OfflineSystem:
    kind: str
    system: str
    argv: tuple[str, ...]  # writes its JSON to the path given after --out
    env: Mapping[str, str]
    cwd: Path = REPO


def speculative_json(text: str) -> str:
    """--speculative-config: a JSON object, checked here so that a typo is a usage error, not a
    failed run minutes later (the engine and vLLM validate its fields)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return json.dumps(value, sort_keys=True)


def offline_systems(model_folder: Path, common: Sequence[str], kvserve_env: Mapping[str, str],
                    vllm_python: Path, vllm_env: Mapping[str, str], vllm_cwd: Path,
                    vllm_dtype: str = "bfloat16") -> list[OfflineSystem]:
    """kvserve (--dtype auto) and vLLM (`vllm_dtype`) on the same folder and workload (`common`:
    the workload's arguments); vLLM starts in `vllm_cwd` (peers.VllmInstall.workdir says why not
    the repository)."""
    kvserve = (sys.executable, str(BENCHMARKS / "offline.py"), "--system", "kvserve", "--model", str(model_folder),
               "--batch-sizes", "", *common)
    vllm = (str(vllm_python), str(BENCHMARKS / "vllm_offline.py"), "--model", str(model_folder), "--dtype", vllm_dtype,
            *common)
    return [OfflineSystem("kvserve", "kvserve LLM.generate", kvserve, kvserve_env),
            OfflineSystem("vllm", "vLLM LLM.generate", vllm, vllm_env, vllm_cwd)]


def offline_runs(systems: Sequence[OfflineSystem], repeats: int, out_dir: Path,
                 timeout_s: float) -> tuple[list[StageResult], list[dict[str, Any]]]:
    stages, runs = [], []
    for round_, system in alternate(systems, repeats):
        out = out_dir / f"offline-peer-{system.kind}-r{round_ + 1}.json"
        stage = run_stage(f"offline vs peers: {system.system} (round {round_ + 1})", [*system.argv, "--out", str(out)],
                          timeout_s, out_dir / "logs" / f"{out.stem}.log", cwd=system.cwd, env=system.env)
        stages.append(stage)
        if stage.ok:
            row = json.loads(out.read_text())["rows"][0]
            runs.append({"kind": system.kind, "system": row["name"], "round": round_ + 1,
                         "tokens_per_s": row["tokens_per_s"], "output_tokens": row["output_tokens"],
                         "seconds": row["seconds"]})
    return stages, runs


def online_runs(servers: Sequence[Server], dataset: Path, streams: Sequence[int], prompts_at: Mapping[int, int],
                repeats: int, out_dir: Path, timeout_s: float) -> tuple[list[StageResult], list[dict[str, Any]]]:
    """At each stream count, every server in turn, `repeats` rounds; `prompts_at[n]`: requests per run,
    each after a discarded warm-up burst of `n` requests at once (BenchRun.warmups says why)."""
    stages, runs = [], []
    for n in streams:
        for round_, server in alternate(servers, repeats):
            filename = f"online-{server.kind}-c{n}-r{round_ + 1}.json"
            run = BenchRun(server.base_url, dataset, prompts_at[n], out_dir, filename, max_concurrency=n,
                           duration_s=timeout_s - 30, extra_body=server.extra_body, warmups=n)
            stage = run_stage(f"online: {server.system}, {n} streams (round {round_ + 1})", bench_argv(run), timeout_s,
                              out_dir / "logs" / filename.replace(".json", ".log"))
            stages.append(stage)
            if stage.ok:
                runs.append({"kind": server.kind, "system": server.system, "streams": n, "round": round_ + 1,
                             "server_command": server.command, "result": json.loads((out_dir / filename).read_text())})
    return stages, runs


def single_stream_dataset(path: Path, requests: int, prompt_len: int, output_len: int) -> Path:
    """`requests` distinct prompts of `prompt_len` token ids (no prefix shared), `output_len` each."""
    items = [WorkItem([17 + (97 * r + 31 * t) % 40000 for t in range(prompt_len)], output_len) for r in range(requests)]
    return write_workload_jsonl(items, path)


def single_stream_runs(servers: Sequence[Server], dataset: Path, requests: int, repeats: int, out_dir: Path,
                       timeout_s: float) -> tuple[list[StageResult], list[dict[str, Any]]]:
    stages, runs = [], []
    for round_, server in alternate(servers, repeats):
        filename = f"single-{server.kind}-r{round_ + 1}.json"
        run = BenchRun(server.base_url, dataset, requests, out_dir, filename, max_concurrency=1,
                       duration_s=timeout_s - 30, extra_body=server.extra_body)
        stage = run_stage(f"single stream: {server.system} (round {round_ + 1})", bench_argv(run), timeout_s,
                          out_dir / "logs" / filename.replace(".json", ".log"))
        stages.append(stage)
        if stage.ok:
            runs.append({"kind": server.kind, "system": server.system, "round": round_ + 1,
                         "server_command": server.command, "result": json.loads((out_dir / filename).read_text())})
    return stages, runs
