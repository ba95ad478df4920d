"""Building the C++ kernel: once per machine (cache dir), safe when processes race, and a clear
fallback where no compiler works. A fake compiler stands in so these tests take no compile."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from kvserve.kernels.cpu_attention import load_cpu_kernel
from kvserve.kernels.cpu_kernel_build import KernelBuildError, build_library

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
