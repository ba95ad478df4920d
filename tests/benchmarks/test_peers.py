"""The runs against the peers alternate (A B A B), and each peer gets the settings the benchmark
promises: vLLM bound to every core with its preloads, llama.cpp built CPU-only outside the repo."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import peer_stages
import pytest
from peer_stages import Server, alternate, online_runs, single_stream_dataset, single_stream_runs
from peers import LLAMA_TARGETS, llama_cmake_commands, vllm_environment
from serving import KvserveServerOptions, VllmServerOptions, kvserve_serve_argv, vllm_server_argv
from stages import StageResult


def test_rounds_run_every_system_once_in_the_same_order() -> None:
    assert alternate(["kvserve", "vllm", "llama"], 2) == [(0, "kvserve"), (0, "vllm"), (0, "llama"),
                                                         (1, "kvserve"), (1, "vllm"), (1, "llama")]
    with pytest.raises(ValueError):
        alternate(["kvserve"], 0)


def _fake_stage(order: list[tuple[str, list[str]]]) -> Any:
    """Stands in for run_stage: records the call and writes the result file kvserve-bench would."""
    def run_stage(name: str, argv: list[str], timeout_s: float, log_path: Path, **_: Any) -> StageResult:
        order.append((name, argv))
        out = Path(argv[argv.index("--result-dir") + 1]) / argv[argv.index("--result-filename") + 1]
        out.write_text(json.dumps({"output_throughput": 1.0, "num_prompts": int(argv[argv.index("--num-prompts") + 1])}))
        return StageResult(name, "ok", "kvserve-bench", 1.0)
    return run_stage


SERVERS = [Server("kvserve", "kvserve", "kvserve serve", "http://127.0.0.1:1"),
           Server("llama.cpp", "llama-server", "llama-server", "http://127.0.0.1:2", '{"cache_prompt": false}')]


def test_online_runs_alternate_at_each_stream_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(peer_stages, "run_stage", _fake_stage(order))
    stages, runs = online_runs(SERVERS, tmp_path / "w.jsonl", (64, 1), {64: 64, 1: 16}, 2, tmp_path, 600)
    assert [name for name, _ in order] == [
        "online: kvserve, 64 streams (round 1)", "online: llama-server, 64 streams (round 1)",
        "online: kvserve, 64 streams (round 2)", "online: llama-server, 64 streams (round 2)",
        "online: kvserve, 1 streams (round 1)", "online: llama-server, 1 streams (round 1)",
        "online: kvserve, 1 streams (round 2)", "online: llama-server, 1 streams (round 2)"]
    first_llama = order[1][1]
    assert first_llama[first_llama.index("--max-concurrency") + 1] == "64"
    assert first_llama[first_llama.index("--extra-body") + 1] == '{"cache_prompt": false}'
    assert order[4][1][order[4][1].index("--num-prompts") + 1] == "16"
    # every measured run is warmed by a discarded burst at its own concurrency
    assert [argv[argv.index("--num-warmups") + 1] for _, argv in order] == ["64"] * 4 + ["1"] * 4
    assert [(r["kind"], r["streams"], r["round"]) for r in runs][:2] == [("kvserve", 64, 1), ("llama.cpp", 64, 1)]
    assert all(s.ok for s in stages) and len(runs) == 8


def test_single_stream_runs_one_request_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(peer_stages, "run_stage", _fake_stage(order))
    dataset = single_stream_dataset(tmp_path / "single.jsonl", 3, 32, 128)
    lines = [json.loads(line) for line in dataset.read_text().splitlines()]
    assert [len(line["prompt"]) for line in lines] == [32] * 3 and {line["output_len"] for line in lines} == {128}
    assert len({tuple(line["prompt"]) for line in lines}) == 3 and min(min(line["prompt"]) for line in lines) >= 17
    _, runs = single_stream_runs(SERVERS, dataset, 3, 2, tmp_path, 600)
    assert all(argv[argv.index("--max-concurrency") + 1] == "1" for _, argv in order)
    assert [(r["kind"], r["round"]) for r in runs] == [("kvserve", 1), ("llama.cpp", 1), ("kvserve", 2), ("llama.cpp", 2)]


def test_vllm_gets_every_core_and_its_documented_preloads(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    env = vllm_environment(tmp_path, 2, base={"PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "lib" / "libiomp5.so")
    assert "libiomp5" not in vllm_environment(tmp_path / "elsewhere", 1, base={}).get("LD_PRELOAD", "")


def test_llama_cpp_is_built_cpu_only_release_with_the_server_and_bench_targets(tmp_path: Path) -> None:
    configure, build = llama_cmake_commands(tmp_path / "src", tmp_path / "build", jobs=2)
    assert configure[configure.index("-S") + 1] == str(tmp_path / "src")
    assert {"-DGGML_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF"} <= set(configure)
    assert any(option.startswith("-DCMAKE_CXX_FLAGS=") and "-mno-amx-int8" in option for option in configure)
    assert build[-len(LLAMA_TARGETS):] == list(LLAMA_TARGETS) and build[build.index("-j") + 1] == "2"


def test_vllm_serve_and_kvserve_get_the_same_limits(tmp_path: Path) -> None:
    (tmp_path / "python").write_text("")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    vllm = vllm_server_argv(9000, VllmServerOptions(tmp_path / "python", tmp_path / "model"))
    kv = kvserve_serve_argv(9001, KvserveServerOptions(quantization="int4"))
    for flag in ("--max-model-len", "--max-num-seqs"):
        assert vllm[vllm.index(flag) + 1] == kv[kv.index(flag) + 1]
    assert "--no-enable-prefix-caching" in vllm and "--no-enable-prefix-caching" in kv
    assert kv[kv.index("--quantization") + 1] == "int4"
    assert vllm[vllm.index("--dtype") + 1] == "bfloat16"
    # On a CPU without bf16 arithmetic, where kvserve's auto runs float32, vLLM can be asked to as well.
    fp32 = vllm_server_argv(9000, VllmServerOptions(tmp_path / "python", tmp_path / "model", dtype="float32"))
    assert fp32[fp32.index("--dtype") + 1] == "float32"
    with pytest.raises(FileNotFoundError, match="config.json"):
        VllmServerOptions(tmp_path / "python", tmp_path)


def test_the_plans_give_one_request_count_per_stream_level() -> None:
    import run_all

    assert run_all.FULL.online_prompts() == {64: 64, 16: 32, 1: 6}
    assert set(run_all.QUICK.online_prompts()) == set(run_all.QUICK.online_streams)
    fields = {**run_all.QUICK.__dict__}
    with pytest.raises(ValueError, match="one count per stream level"):
        run_all.Plan(**{**fields, "online_requests": (6,)})
    with pytest.raises(ValueError, match="at most num_requests"):
        run_all.Plan(**{**fields, "online_requests": (6, fields["num_requests"] + 1)})


def test_speculative_config_is_a_json_object_both_engines_get_alike(tmp_path: Path) -> None:
    spec = peer_stages.speculative_json('{"num_speculative_tokens": 4, "method": "ngram"}')
    assert json.loads(spec) == {"method": "ngram", "num_speculative_tokens": 4}
    for bad in ('{"method": "ngram"', '["ngram"]', "4"):
        with pytest.raises(argparse.ArgumentTypeError):
            peer_stages.speculative_json(bad)
    common = ["--num-requests", "64", "--speculative-config", spec]
    systems = peer_stages.offline_systems(tmp_path / "hf", common, {}, tmp_path / "python", {}, tmp_path)
    assert [s.kind for s in systems] == ["kvserve", "vllm"]
    for system in systems:
        assert system.argv[system.argv.index("--speculative-config") + 1] == spec


def test_both_servers_get_the_same_speculative_config(tmp_path: Path) -> None:
    (tmp_path / "python").write_text("")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    spec = peer_stages.speculative_json('{"method": "ngram", "num_speculative_tokens": 4}')
    vllm = vllm_server_argv(9000, VllmServerOptions(tmp_path / "python", tmp_path / "model", speculative_config=spec))
    kv = kvserve_serve_argv(9001, KvserveServerOptions(speculative_config=spec))
    assert vllm[vllm.index("--speculative-config") + 1] == kv[kv.index("--speculative-config") + 1] == spec
    assert "--speculative-config" not in kvserve_serve_argv(9001, KvserveServerOptions())
