"""Where no C++ compiler is installed (the slim CPU container image), or one is but torch's C++
headers are not (an image that strips them), the engine serves with an eager forward instead of
failing at start-up: inductor's CPU code generation compiles C++ against those headers. Where it
compiles, a second start finds the graphs in inductor's cache (the start-up log counts them)."""

import logging
import re
from pathlib import Path

import pytest
import torch

from kvserve.engine import EngineConfig
from kvserve.engine.engine_builder import build_engine_parts
from kvserve.kernels import cpu_kernel_build
from tests.server.tiny_checkpoint import write_tiny_checkpoint


def _tiny_config(tmp_path: Path, **options: object) -> EngineConfig:
    return EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "tiny")), dtype="float32", num_kv_blocks=64,
                        **options)


def test_without_a_cxx_compiler_the_forward_runs_eagerly_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="kvserve.engine.engine_builder"):
        parts = build_engine_parts(_tiny_config(tmp_path))
    assert parts.executor.driver.runner.compiled is False
    assert "no C++ compiler" in caplog.text and "no-such-compiler" in caplog.text


def test_a_compiler_without_torch_headers_runs_the_forward_eagerly_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The compiler is real (or a stand-in that answers --version); the headers are what is missing.
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho fake-cc 1.0\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setattr(cpu_kernel_build, "TORCH_DIR", tmp_path / "stripped-torch")
    with caplog.at_level(logging.WARNING, logger="kvserve.engine.engine_builder"):
        parts = build_engine_parts(_tiny_config(tmp_path))
    assert parts.executor.driver.runner.compiled is False
    assert "torch's C++ headers are missing" in caplog.text


def test_enforce_eager_needs_no_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="kvserve.engine.engine_builder"):
        parts = build_engine_parts(_tiny_config(tmp_path, enforce_eager=True))
    assert parts.executor.driver.runner.compiled is False
    assert "no C++ compiler" not in caplog.text


@pytest.mark.slow
def test_a_second_start_finds_its_graphs_in_the_cache_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # What a container image whose cache was filled at build time relies on.
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    config = _tiny_config(tmp_path)
    counts = []
    for _ in range(2):
        torch._dynamo.reset()  # a fresh process: nothing compiled in memory
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvserve.engine.compilation"):
            assert build_engine_parts(config).executor.driver.runner.compiled
        (line,) = [r.getMessage() for r in caplog.records if "forward compiled in" in r.getMessage()]
        counts.append(tuple(int(n) for n in re.findall(r"(\d+) (?:hits|misses)", line)))
    (first_hits, first_misses), (second_hits, second_misses) = counts
    assert first_hits == 0 and first_misses > 0
    assert second_hits == first_misses and second_misses == 0
