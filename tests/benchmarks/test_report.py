"""REPORT.md from a summary: the tables hold the numbers and ratios, and anything missing says why."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from report import render_report, write_report

ONLINE = {"completed": 64, "failed": 0, "duration": 40.0, "request_throughput": 1.6, "output_throughput": 218.0,
          "mean_ttft_ms": 900.0, "p99_ttft_ms": 2000.0, "mean_tpot_ms": 95.0, "p99_tpot_ms": 120.0,
          "mean_itl_ms": 94.0, "p99_e2el_ms": 30000.0}


def summary() -> dict[str, Any]:
    return {
        "generated_at": "2026-01-01T00:00:00", "quick": False, "command": "python benchmarks/run_all.py",
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 24.0, "os": "Linux", "python": "3.11",
                    "load_average_at_start": [0.5, 0.4, 0.3], "git_revision": "abc1234",
                    "versions": {"torch": "2.13.0", "transformers": "5.0"}},
        "workload": {"seed": 0, "num_requests": 64, "prompt_len": [16, 256], "output_len": [16, 256],
                     "input_tokens": 8000, "output_tokens": 9000, "jsonl": "benchmarks/results/workload.jsonl"},
        "offline": [
            {"name": "kvserve continuous batching", "kind": "kvserve-continuous", "output_tokens": 9000,
             "seconds": 30.0, "tokens_per_s": 300.0},
            {"name": "transformers generate, static batches of 8", "kind": "transformers-static",
             "output_tokens": 9000, "seconds": 90.0, "tokens_per_s": 100.0},
            {"name": "transformers generate, static batches of 16", "kind": "transformers-static",
             "output_tokens": 9000, "seconds": 60.0, "tokens_per_s": 150.0},
        ],
        "online": [{"kind": "kvserve", "system": "kvserve", "streams": 64, "round": 1,
                    "server_command": "kvserve serve --port 1", "result": dict(ONLINE)}],
        "peer_repeats": 2,
        "sweep": {"num_prompts": 32, "rates": "1,inf", "pngs": ["sweep-kvserve-ttft_cdf.png"],
                  "points": [{**ONLINE, "request_rate": 1.0}, {**ONLINE, "request_rate": "inf"}]},
        "stages": [
            {"name": "offline: kvserve", "status": "ok", "command": "python benchmarks/offline.py", "seconds": 40.0,
             "note": "", "log": ""},
            {"name": "offline: transformers continuous batching", "status": "timed out", "command": "python x",
             "seconds": 1200.0, "note": "killed at the 1200 s limit", "log": ""},
            {"name": "online: llama.cpp llama-server", "status": "skipped", "command": "", "seconds": 0.0,
             "note": "no --llama-server PATH was given", "log": ""},
            {"name": "online: vLLM", "status": "skipped", "command": "", "seconds": 0.0,
             "note": "no --with-vllm was given", "log": ""},
        ],
    }


def test_offline_table_has_ratios_against_kvserve_continuous() -> None:
    text = render_report(summary())
    assert "| kvserve continuous batching | 9,000 | 30.0 | 300.0 | 1.00x |" in text
    assert "| transformers generate, static batches of 8 | 9,000 | 90.0 | 100.0 | 3.00x |" in text
    assert "transformers generate, static batches of 16 (150.0 tokens/s, kvserve continuous is 2.00x)" in text


def test_missing_stages_are_reported_with_their_reason() -> None:
    text = render_report(summary())
    assert "- **offline: transformers continuous batching**: timed out. killed at the 1200 s limit" in text
    assert "- **online: llama.cpp llama-server**: skipped. no --llama-server PATH was given" in text
    assert "- **online: vLLM**: skipped. no --with-vllm was given" in text


def test_online_and_sweep_rows_and_plots() -> None:
    text = render_report(summary())
    assert "| 64 | 1 | kvserve | 64 | 0 | 40.0 | 1.60 | 218.0 | 900 | 2,000 | 95.0 | 120.0 | 94.0 | 30,000 |" in text
    assert "| inf | 64 | 0 | 40.0 |" in text and "| 1.0 | 64 | 0 |" in text
    assert "![sweep-kvserve-ttft_cdf](sweep-kvserve-ttft_cdf.png)" in text
    assert "`kvserve serve --port 1`" in text


def test_busy_machine_and_quick_runs_are_flagged() -> None:
    data = summary()
    assert "Warning: the load average" not in render_report(data)
    data["machine"]["load_average_at_start"] = [5.0, 4.0, 3.0]
    data["quick"] = True
    text = render_report(data)
    assert "Warning: the load average was 5.0 on 2 cores" in text
    assert "Quick smoke run" in text


def test_nothing_measured_says_so_instead_of_empty_tables() -> None:
    data = summary()
    data.update(offline=[], online=[], sweep={})
    text = render_report(data)
    assert "No offline results." in text and "No online results." in text and "No sweep results." in text
    assert "No single-stream results." in text
    assert "n/a" not in text


def test_missing_latency_is_na_not_zero() -> None:
    data = copy.deepcopy(summary())
    data["online"][0]["result"].update(mean_tpot_ms=None, p99_tpot_ms=None)
    assert "| 95.0 | 120.0 |" not in render_report(data).split("## 3.")[0]
    assert "| n/a | n/a |" in render_report(data)


def test_write_report_writes_markdown_and_comparison_png(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    path = write_report(summary(), tmp_path)
    assert path.read_text().startswith("# kvserve benchmark report")
    assert (tmp_path / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![offline and online throughput](comparison.png)" in path.read_text()


def _with_ceiling_and_profile() -> dict[str, Any]:
    data = summary()
    data["ceiling"] = {
        "threads": 2, "input_tokens": 8000, "output_tokens": 9000, "headline_rows": 64,
        "shapes": [{"name": "qkv", "out_features": 960, "in_features": 576, "per_forward": 30}],
        "matmul_ms": {"1": {"qkv": 0.05}, "64": {"qkv": 0.2}},
        "ceiling_tokens_per_s": {"1": 100.0, "64": 600.0}, "single_stream_floor_ms": 26.0,
        "kvserve_tokens_per_s": 300.0,
    }
    data["step_profile"] = {"prompt_len": 128, "steps": {"decode x1": {"linear layers": 30.0, "attention": 10.0,
                                                                      "step total": 50.0}}}
    data["quantization"] = {
        "prompts": 16, "max_tokens": 64, "bf16_floor_ms": 20.0,
        "accuracy": [{"weights": "int4", "identical": 4, "agreeing_tokens": 512, "total_tokens": 1024,
                      "passage_nll": 4.3553}],
        "speed": {"int4": {"weight_pass_ms": 6.0, "tpot_ms": 9.0}},
    }
    return data


def test_ceiling_step_profile_and_quantization_sections() -> None:
    text = render_report(_with_ceiling_and_profile())
    assert "| 64 (headline) | 600.0 | 50% |" in text and "| 1 | 100.0 | 300% |" in text
    assert "| 1 | 0.050 |" in text and "26.0 ms per token with `F.linear`." in text
    assert "| linear layers | 30.00 (60%) |" in text and "| step total | 50.00 |" in text
    assert "| int4 | 4/16 | 50.0% | 4.3553 |" in text and "| int4 | 6.0 (0.30x) | 9.0 (0.45x) |" in text


def test_the_ceiling_with_prepacked_weights_is_a_second_yardstick() -> None:
    data = _with_ceiling_and_profile()
    data["ceiling"] |= {"packed_ceiling_tokens_per_s": {"1": 150.0, "64": 1200.0},
                        "packed_single_stream_floor_ms": 20.0}
    text = render_report(data)
    assert "| 64 (headline) | 600.0 | 50% | 1,200.0 | 25% |" in text
    assert "26.0 ms per token with `F.linear`, 20.0 ms with prepacked weights." in text


def test_unmeasured_ceiling_profile_and_quantization_say_so() -> None:
    text = render_report(summary())
    assert text.count("Not measured.") == 3


def _online_run(kind: str, system: str, streams: int, round_: int, tput: float, ttft: float, tpot: float) -> dict:
    return {"kind": kind, "system": system, "streams": streams, "round": round_, "server_command": f"{kind} serve",
            "result": {**ONLINE, "num_prompts": 64, "output_throughput": tput, "median_ttft_ms": ttft,
                       "median_tpot_ms": tpot}}


def _with_peers() -> dict[str, Any]:
    data = summary()
    data["online"] = [_online_run("kvserve", "kvserve", 64, 1, 300.0, 800.0, 90.0),
                      _online_run("vllm", "vLLM 0.32.0 vllm serve (bf16)", 64, 1, 200.0, 1000.0, 110.0),
                      _online_run("kvserve", "kvserve", 64, 2, 320.0, 700.0, 80.0),
                      _online_run("vllm", "vLLM 0.32.0 vllm serve (bf16)", 64, 2, 240.0, 900.0, 100.0),
                      _online_run("kvserve", "kvserve", 1, 1, 30.0, 50.0, 30.0)]
    data["offline_peers"] = [
        {"kind": "kvserve", "system": "kvserve LLM.generate", "round": 1, "tokens_per_s": 500.0, "output_tokens": 9000,
         "seconds": 18.0},
        {"kind": "vllm", "system": "vLLM 0.32.0 LLM.generate", "round": 1, "tokens_per_s": 400.0, "output_tokens": 9000,
         "seconds": 22.5},
        {"kind": "kvserve", "system": "kvserve LLM.generate", "round": 2, "tokens_per_s": 450.0, "output_tokens": 9000,
         "seconds": 20.0},
        {"kind": "vllm", "system": "vLLM 0.32.0 LLM.generate", "round": 2, "tokens_per_s": 500.0, "output_tokens": 9000,
         "seconds": 18.0}]
    single = [("kvserve-int4", "kvserve --quantization int4", 16.0), ("llama.cpp", "llama.cpp llama-server (Q4_1)", 8.0),
              ("kvserve", "kvserve", 25.0), ("vllm", "vLLM 0.32.0 vllm serve (bf16)", 25.0)]
    data["single_stream"] = {"requests": 4, "prompt_len": 32, "output_len": 128, "runs": [
        {"kind": kind, "system": system, "round": round_, "server_command": "x",
         "result": {**ONLINE, "median_tpot_ms": ms + round_}} for round_ in (1, 2) for kind, system, ms in single]}
    return data


def test_offline_against_vllm_shows_every_round_its_ratio_and_the_medians() -> None:
    text = render_report(_with_peers())
    assert "| 1 | 500.0 | 400.0 | 1.25x |" in text and "| 2 | 450.0 | 500.0 | 0.90x |" in text
    assert "| median | 475.0 | 450.0 | 1.06x |" in text


def test_online_medians_per_stream_count_and_the_ratio_against_each_peer() -> None:
    text = render_report(_with_peers())
    assert "| 64 | kvserve | 300.0, 320.0 | 310.0 | 750 | 85.0 | 0 | - |" in text
    assert "| 64 | vLLM 0.32.0 vllm serve (bf16) | 200.0, 240.0 | 220.0 | 950 | 105.0 | 0 | 1.41x |" in text
    assert "| 1 | kvserve | 30.0 | 30.0 |" in text
    assert "- vLLM 0.32.0 vllm serve (bf16): `vllm serve`" in text


def test_single_stream_compares_int4_with_llama_cpp_and_bf16_with_vllm() -> None:
    text = render_report(_with_peers())
    assert "| kvserve --quantization int4 | 17.00, 18.00 | 17.50 | 1.84x llama.cpp llama-server (Q4_1)'s ms/token |" in text
    assert "| kvserve | 26.00, 27.00 | 26.50 | 1.00x vLLM 0.32.0 vllm serve (bf16)'s ms/token |" in text
    assert "| llama.cpp llama-server (Q4_1) | 9.00, 10.00 | 9.50 | - |" in text


def test_a_peer_that_failed_to_start_is_listed_with_its_reason() -> None:
    data = _with_peers()
    data["stages"].append({"name": "start: vLLM 0.32.0 vllm serve (bf16)", "status": "failed", "command": "vllm serve",
                           "seconds": 5.0, "note": "the server did not start: exited with code 1", "log": ""})
    assert "- **start: vLLM 0.32.0 vllm serve (bf16)**: failed. the server did not start" in render_report(data)


def test_comparison_png_has_the_peers(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    write_report(_with_peers(), tmp_path)
    assert (tmp_path / "comparison.png").stat().st_size > 1000
