"""A stage is bounded: a hung command is killed at its limit, a failing one reports its log's end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from serving import BenchRun, KvserveServerOptions, bench_argv, kvserve_serve_argv
from stages import run_stage


def test_a_stage_that_outlives_its_limit_is_killed(tmp_path: Path) -> None:
    result = run_stage("sleepy", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                       timeout_s=1.5, log_path=tmp_path / "sleepy.log")
    assert result.status == "timed out"
    assert result.seconds < 30
    assert "killed at the 2 s limit" in result.note and "started" in result.note


def test_a_failing_stage_reports_exit_code_and_log(tmp_path: Path) -> None:
    result = run_stage("broken", [sys.executable, "-c", "import sys; print('bad input'); sys.exit(3)"],
                       timeout_s=60, log_path=tmp_path / "broken.log")
    assert result.status == "failed"
    assert result.note.startswith("exit code 3") and "bad input" in result.note
    assert (tmp_path / "broken.log").read_text().strip() == "bad input"


def test_an_ok_stage_shows_the_command_as_typed(tmp_path: Path) -> None:
    result = run_stage("fine", [sys.executable, "-c", "pass"], timeout_s=60, log_path=tmp_path / "fine.log")
    assert (result.status, result.note) == ("ok", "")
    assert result.command == "python -c pass"


def test_server_and_bench_command_lines() -> None:
    serve = kvserve_serve_argv(8123, KvserveServerOptions(num_kv_blocks=100))
    assert serve[1:] == ["serve", "--host", "127.0.0.1", "--port", "8123", "--dtype", "auto", "--max-model-len", "1024",
                         "--max-num-seqs", "64", "--num-kv-blocks", "100", "--log-level", "warning",
                         "--no-enable-prefix-caching"]
    run = BenchRun("http://127.0.0.1:8123", Path("w.jsonl"), 32, Path("out"), "s.json", sweep_rates="1,inf")
    argv = bench_argv(run)
    assert argv[argv.index("--request-rate-sweep") + 1] == "1,inf" and "--request-rate" not in argv
    assert "--ignore-eos" in argv and argv[argv.index("--num-prompts") + 1] == "32"
    assert argv[argv.index("--num-warmups") + 1] == "1"
    with pytest.raises(ValueError, match="warmups"):
        BenchRun("http://127.0.0.1:8123", Path("w.jsonl"), 32, Path("out"), "s.json", warmups=-1)
