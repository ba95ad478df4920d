"""Building the C++ kernel: once per machine (cache dir), safe when processes race, and a clear
fallback where no compiler works. A fake compiler stands in so these tests take no compile."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from kvserve.kernels import cpu_kernel_build
from kvserve.kernels.cpu_attention import load_cpu_kernel
from kvserve.kernels.cpu_kernel_build import KernelBuildError, build_library, cpp_toolchain_problem

FAKE_COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then echo fake-cc 1.0; exit 0; fi
echo compiled >> "{log}"
sleep 0.3
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then echo library > "$2"; fi; shift; done
"""


def _fake_compiler(tmp_path: Path, body: str = FAKE_COMPILER) -> tuple[str, Path]:
    log = tmp_path / "compiles.log"
    compiler = tmp_path / "fake-cc"
    compiler.write_text(body.format(log=log))
    compiler.chmod(0o755)
    return str(compiler), log


def test_compiles_once_even_when_two_callers_race(tmp_path: Path) -> None:
    compiler, log = _fake_compiler(tmp_path)
    cache = tmp_path / "cache"
    results = []
    racers = [threading.Thread(target=lambda: results.append(build_library(cache, compiler))) for _ in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    later = build_library(cache, compiler)
    assert log.read_text().count("compiled") == 1
    assert sorted(result.compiled for result in results) == [False, True] and not later.compiled
    assert {result.library for result in results} == {later.library} and later.library.read_text() == "library\n"
    assert [path.name for path in cache.iterdir() if path.suffix not in (".so", ".lock")] == []  # no partial files


def test_a_failing_compiler_is_a_build_error_naming_its_output(tmp_path: Path) -> None:
    compiler, _ = _fake_compiler(tmp_path, '#!/bin/sh\nif [ "$1" = "--version" ]; then exit 0; fi\necho "syntax error here" >&2\nexit 1\n')
    with pytest.raises(KernelBuildError, match="syntax error here"):
        build_library(tmp_path / "cache", compiler)
    assert not list((tmp_path / "cache").glob("*.so"))


def test_without_a_compiler_the_torch_path_serves_after_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.kernels"):
        assert load_cpu_kernel(tmp_path, compiler="no-such-c++-compiler") is False
    assert len(caplog.records) == 1 and "using the torch path" in caplog.records[0].getMessage()


def _torch_tree(root: Path, headers: tuple[str, ...]) -> Path:
    for header in headers:
        (root / "include" / header).parent.mkdir(parents=True, exist_ok=True)
        (root / "include" / header).write_text("")
    return root


def test_toolchain_needs_a_compiler_torch_headers_and_for_torch_compile_python_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler, _ = _fake_compiler(tmp_path)
    assert cpp_toolchain_problem("no-such-c++-compiler") == "no C++ compiler (no-such-c++-compiler) on PATH"
    monkeypatch.setattr(cpu_kernel_build, "TORCH_DIR", _torch_tree(tmp_path / "stripped", ("torch/library.h",)))
    assert "torch's C++ headers are missing" in cpp_toolchain_problem(compiler)
    assert "cpp_prefix.h" in cpp_toolchain_problem(compiler)
    monkeypatch.setattr(cpu_kernel_build, "TORCH_DIR", _torch_tree(tmp_path / "full", cpu_kernel_build.TORCH_HEADERS))
    assert cpp_toolchain_problem(compiler) is None
    monkeypatch.setattr(cpu_kernel_build.sysconfig, "get_path", lambda name: str(tmp_path / "no-python-include"))
    assert cpp_toolchain_problem(compiler) is None  # the kernel itself needs no Python headers
    assert "Python.h" in cpp_toolchain_problem(compiler, python_headers=True)


def test_without_torch_headers_the_build_error_says_so_before_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler, log = _fake_compiler(tmp_path)
    monkeypatch.setattr(cpu_kernel_build, "TORCH_DIR", tmp_path / "stripped")
    with pytest.raises(KernelBuildError, match="torch's C.. headers are missing"):
        build_library(tmp_path / "cache", compiler)
    assert not log.exists()
