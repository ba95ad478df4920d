"""Building the C++ kernel: once per machine (cache dir), safe when processes race, and a clear
fallback where no compiler works; the prebuilt variants and the choice among them by CPU flags.
A fake compiler stands in so these tests take no compile, except one (slow) that prebuilds and
loads the AVX2 variant."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvserve.kernels import cpu_kernel_build
from kvserve.kernels.cpu_attention import load_cpu_kernel
from kvserve.kernels.cpu_kernel_build import KernelBuildError, build_library, cpp_toolchain_problem

REPO = Path(__file__).resolve().parents[2]
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


def test_without_a_compiler_the_torch_path_serves_after_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_kernel_build, "PREBUILT_DIR", tmp_path / "no-prebuilt")
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


VARIANT_FLAGS = {v.name: v.cpu_flags for v in cpu_kernel_build.ISA_VARIANTS}
SAPPHIRE_RAPIDS = VARIANT_FLAGS["amx"] | {"sse4_2", "avx512_fp16"}
ZEN_4 = VARIANT_FLAGS["avx512"] | {"avx512_bf16", "avx512_vnni", "sse4_2"}  # no AMX
ICE_LAKE = VARIANT_FLAGS["avx512"] | {"avx512_vnni", "sse4_2"}  # no AVX-512 BF16
HASWELL = VARIANT_FLAGS["avx2"] | {"sse4_2"}
ALL = [v.name for v in cpu_kernel_build.ISA_VARIANTS]


@pytest.mark.parametrize("flags,available,expected", [
    (SAPPHIRE_RAPIDS, ALL, "amx"), (ZEN_4, ALL, "avx512bf16"), (ICE_LAKE, ALL, "avx512"), (HASWELL, ALL, "avx2"),
    (ZEN_4, ["amx", "avx512", "avx2"], "avx512"),  # a package built before the BF16 variant existed
    (SAPPHIRE_RAPIDS, ["avx2"], "avx2"),  # the best that was built, not the best the CPU could run
    (HASWELL, ["amx", "avx512"], None), (frozenset({"sse4_2", "avx"}), ALL, None),
])
def test_the_best_prebuilt_variant_this_cpu_can_run_is_picked(flags, available, expected) -> None:
    picked = cpu_kernel_build.pick_variant(frozenset(flags), available)
    assert (picked.name if picked else None) == expected


def _prebuilt_dir(root: Path, **manifest_fields: object) -> Path:
    root.mkdir()
    (root / "cpu_paged_attention-avx2.so").write_text("library")
    manifest = {"torch": torch.__version__, "source_sha256": cpu_kernel_build._source_digest(), "variants": ["avx2"]}
    (root / cpu_kernel_build.MANIFEST).write_text(json.dumps(manifest | manifest_fields))
    return root


def test_a_prebuilt_library_is_used_only_for_its_torch_its_source_and_a_cpu_that_runs_it(tmp_path: Path) -> None:
    found = cpu_kernel_build.prebuilt_library(_prebuilt_dir(tmp_path / "ok"), HASWELL)
    assert found is not None and found.variant == "avx2" and found.library.name == "cpu_paged_attention-avx2.so"
    assert cpu_kernel_build.prebuilt_library(_prebuilt_dir(tmp_path / "torch", torch="1.0.0"), HASWELL) is None
    assert cpu_kernel_build.prebuilt_library(_prebuilt_dir(tmp_path / "src", source_sha256="0" * 64), HASWELL) is None
    assert cpu_kernel_build.prebuilt_library(tmp_path / "ok", frozenset({"sse4_2"})) is None
    assert cpu_kernel_build.prebuilt_library(tmp_path / "nothing-here", HASWELL) is None


CHECK_PREBUILT = """
import sys
from pathlib import Path
import torch
from kvserve.kernels import cpu_kernel_build
cpu_kernel_build.PREBUILT_DIR = Path(sys.argv[1])
from kvserve.kernels.cpu_attention import cpu_paged_attention, load_cpu_kernel
from kvserve.kernels.torch_attention import torch_paged_attention
from tests.kernels.paged_batch import TOLERANCES, make_batch
assert load_cpu_kernel(compiler="no-such-c++-compiler")  # no compiler: only the prebuilt can serve
# The AVX2 build's own route for fp32/bf16/fp16 caches: decodes, prompt chunks, several groups and
# head dims, a sliding window and a soft cap.
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for head_dim, group, window, cap in [(64, 3, 0, 0.0), (128, 8, 0, 0.0), (64, 1, 24, 0.0), (64, 4, 0, 5.0)]:
        batch = make_batch([1, 17, 200, 33, 300], [1, 1, 40, 33, 1], num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
        out = cpu_paged_attention(*batch.attention_args()[:-1], batch.scale, 1.0, window, cap)
        want = torch_paged_attention(*batch.attention_args(), sliding_window=window, soft_cap=cap)
        torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[dtype])
print("prebuilt ok")
"""


@pytest.mark.slow
def test_the_prebuilt_avx2_build_loads_without_a_compiler_and_matches_the_torch_path() -> None:
    # AVX2 is the portable vector code that this machine's native (AVX-512/AMX) build never runs.
    # Built once per source revision and torch, into the kvserve cache (a compile takes minutes).
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler to prebuild with")
    variant = cpu_kernel_build.pick_variant(cpu_kernel_build.cpu_flags(), ["avx2"])
    if variant is None:
        pytest.skip("this CPU cannot run the AVX2 build")
    key = hashlib.sha256(f"{torch.__version__} {cpu_kernel_build._source_digest()}".encode()).hexdigest()[:16]
    out = cpu_kernel_build.default_cache_dir() / f"prebuilt-test-{key}"
    if cpu_kernel_build.prebuilt_library(out, HASWELL) is None:
        cpu_kernel_build.prebuild(out, variants=[variant])
    done = subprocess.run([sys.executable, "-c", CHECK_PREBUILT, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "prebuilt ok" in done.stdout, done.stdout + done.stderr
