"""Compiles the C++ CPU attention kernel once per machine and loads it into torch.ops.

Why not `torch.utils.cpp_extension.load`: it needs a `ninja` executable on PATH, imports
setuptools (slow, and noisy in an editable install), and guards its build with a lock *file* that
a killed process leaves behind, after which every later process waits forever. Here the compiler
is called directly with the paths and ABI flag cpp_extension would use (torch/include, torch/lib);
the lock is an flock (released by the OS when its holder dies); the library is written under a
temporary name and renamed, so a reader never sees half a file.

The library's file name carries a hash of everything that changes the binary (the source, the
flags, torch's version, the compiler, the CPU's instruction-set flags for -march=native), so a
cache shared by several machines or checkouts never loads a wrong build and never rebuilds a
right one.

Ahead of time, as vLLM ships `_C` (AVX-512) beside `_C_AVX2`: `python kernels/cpu_kernel_build.py
prebuild` compiles one library per instruction-set family (ISA_VARIANTS: AMX, AVX-512 BF16,
AVX-512, AVX2) into kernels/prebuilt/, which the package carries (the container image builds
them). At run time the best variant this CPU's flags allow is loaded, with no compiler needed;
where none fits (another torch, another source, an older CPU) the kernel is compiled for this
machine as above.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_attention.cpp"
COMPILE_TIMEOUT_S = 600
TORCH_DIR = Path(torch.__file__).parent
FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
NATIVE = ("-march=native",)
PREBUILT_DIR = Path(__file__).with_name("prebuilt")
MANIFEST = "manifest.json"
# Headers a compile against torch reads, relative to torch/include: the kernel's registration
# header, and the prefix of every C++ file torch.compile generates for the CPU. Images that strip
# torch's headers to save space (62 MB) keep the compiler's check from meaning anything alone.
TORCH_HEADERS = ("torch/library.h", "torch/csrc/inductor/cpp_prefix.h")


@dataclass(frozen=True)
class IsaVariant:
    """An ahead-of-time build for a family of CPUs: the flags that replace -march=native, and the
    /proc/cpuinfo flags a CPU must show to run it."""

    name: str
    march: tuple[str, ...]
    cpu_flags: frozenset[str]


# x86-64 microarchitecture levels as /proc/cpuinfo names their features (lzcnt is "abm").
_X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave", "abm"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Best first. AMX: Sapphire Rapids and later (the kernel's tile path, which asks Linux for the tile
# state at run time); AVX-512 BF16: AMD Zen 4 and 5, Cooper Lake (bf16 decodes in vdpbf16ps);
# AVX-512: Skylake-SP to Ice Lake; AVX2: the rest since Haswell.
ISA_VARIANTS = (
    IsaVariant("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
               _X86_64_V4 | {"avx512_bf16", "amx_tile", "amx_bf16"}),
    IsaVariant("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16"), _X86_64_V4 | {"avx512_bf16"}),
    IsaVariant("avx512", ("-march=x86-64-v4",), _X86_64_V4),
    IsaVariant("avx2", ("-march=x86-64-v3",), _X86_64_V3),
)


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded here (no compiler, compile error, ...)."""


@dataclass(frozen=True)
class BuildResult:
    library: Path
    compiled: bool  # False: an earlier process's build was reused, or a prebuilt one
    seconds: float  # compile (or lookup) plus load time
    variant: str = "native"  # an ISA_VARIANTS name for a prebuilt library


def default_cache_dir() -> Path:
    """$KVSERVE_CACHE (as the engine uses it) or ~/.cache/kvserve, then cpu_kernels/."""
    return Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve") / "cpu_kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command(compiler: str, output: Path, source: Path = SOURCE, march: Sequence[str] = NATIVE) -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [compiler, *FLAGS, *march, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    lib = TORCH_DIR / "lib"
    command += [f"-I{TORCH_DIR / 'include'}", str(source), "-o", str(output), f"-L{lib}", f"-Wl,-rpath,{lib}"]
    # torch's lib/ also holds the libgomp that torch itself uses: linking against it keeps one
    # OpenMP runtime (one thread pool) in the process.
    return command + ["-lc10", "-ltorch_cpu", "-ltorch"]


def _library_path(cache_dir: Path, compiler: str, source: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(_command(compiler, Path("out"), Path("source.cpp"))).encode(),
                 torch.__version__.encode(), version.encode(), _cpu_flags().encode()):
        digest.update(part)
    return cache_dir / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def cxx_compiler() -> str:
    """The C++ compiler this machine would use ($CXX, else c++), whether or not it is installed."""
    return os.environ.get("CXX", "c++")


def cpp_toolchain_problem(compiler: str | None = None, *, python_headers: bool = False) -> str | None:
    """Why C++ against torch cannot be compiled here, or None where it can: this kernel and
    torch.compile's CPU code generation both need a compiler and torch's C++ headers (slim
    container images have no compiler, and some strip the headers); torch.compile's kernels are
    Python extension modules, so `python_headers` also asks for Python.h."""
    compiler = compiler or cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    missing = [header for header in TORCH_HEADERS if not (TORCH_DIR / "include" / header).is_file()]
    if missing:
        return f"torch's C++ headers are missing ({TORCH_DIR / 'include' / missing[0]})"
    if python_headers and not (Path(sysconfig.get_path("include")) / "Python.h").is_file():
        return f"Python's C headers are missing ({Path(sysconfig.get_path('include')) / 'Python.h'})"
    return None


def build_library(cache_dir: Path, compiler: str | None = None, source: Path = SOURCE) -> BuildResult:
    """The compiled library, compiling it only if no process on this machine has yet. `source`
    other than the kernel's own is for benchmarks (an earlier revision, under its own op namespace)."""
    started = time.perf_counter()
    compiler = compiler or cxx_compiler()
    problem = cpp_toolchain_problem(compiler)
    if problem is not None:
        raise KernelBuildError(problem)
    cache_dir.mkdir(parents=True, exist_ok=True)
    library = _library_path(cache_dir, compiler, source)
    if library.exists():
        return BuildResult(library, compiled=False, seconds=time.perf_counter() - started)
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same thing: wait for it
        if library.exists():
            return BuildResult(library, compiled=False, seconds=time.perf_counter() - started)
        logger.info("compiling the CPU kernel %s into %s (once per machine)", source.name, cache_dir)
        partial = library.with_suffix(f".{os.getpid()}.partial")
        result = subprocess.run(_command(compiler, partial, source), capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise KernelBuildError(f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(partial, library)
    return BuildResult(library, compiled=True, seconds=time.perf_counter() - started)


@functools.cache  # the machine's: read once, not once per layer packed
def cpu_flags() -> frozenset[str]:
    return frozenset(_cpu_flags().partition(":")[2].split())


def load_optional_kernel(source: Path, required_flags: frozenset[str], name: str, fallback: str,
                         cache_dir: Path | None = None, compiler: str | None = None,
                         flags: frozenset[str] | None = None) -> bool:
    """Builds (once per machine) and loads an optional kernel library (`name`, e.g. "VNNI int4/int8
    kernels") that needs `required_flags` of /proc/cpuinfo; False, said in one log line naming
    the `fallback` its callers then use, where this CPU lacks the instructions (nothing is
    built) or the build or the load fails. `flags` stands for the CPU's (tests)."""
    missing = required_flags - (cpu_flags() if flags is None else flags)
    if missing:
        logger.info("%s unavailable (this CPU lacks %s): %s", name, ", ".join(sorted(missing)), fallback)
        return False
    try:
        result = build_library(cache_dir or default_cache_dir(), compiler, source=source)
        torch.ops.load_library(str(result.library))
    except (KernelBuildError, OSError, subprocess.SubprocessError) as error:
        logger.warning("%s unavailable, %s: %s", name, fallback, error)
        return False
    if result.compiled:
        logger.info("compiled the %s in %.1f s (cached in %s)", name, result.seconds, result.library.parent)
    return True


def pick_variant(flags: frozenset[str], available: Sequence[str]) -> IsaVariant | None:
    """The best of the `available` variants that a CPU with these flags can run."""
    return next((v for v in ISA_VARIANTS if v.name in available and v.cpu_flags <= flags), None)


def _source_digest(source: Path = SOURCE) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()


def prebuild(out_dir: Path | None = None, compiler: str | None = None,
             variants: Sequence[IsaVariant] = ISA_VARIANTS) -> list[Path]:
    """Compiles one library per variant into `out_dir` (default: the package's prebuilt/), with a
    manifest naming the torch and the source they were built for (a library built for another
    torch must not be loaded)."""
    out_dir = out_dir or PREBUILT_DIR
    compiler = compiler or cxx_compiler()
    problem = cpp_toolchain_problem(compiler)
    if problem is not None:
        raise KernelBuildError(problem)
    out_dir.mkdir(parents=True, exist_ok=True)
    libraries = [out_dir / f"{SOURCE.stem}-{variant.name}.so" for variant in variants]
    # The variants compile side by side: each compile is single-threaded.
    compiles = [subprocess.Popen(_command(compiler, library, SOURCE, variant.march), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for variant, library in zip(variants, libraries)]
    failures = []
    for variant, process in zip(variants, compiles):
        try:
            _, stderr = process.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        if process.returncode != 0:
            failures.append(f"{variant.name} ({process.returncode}): {stderr.strip()[-2000:]}")
    if failures:
        raise KernelBuildError(f"{compiler} failed for " + "; ".join(failures))
    manifest = {"torch": torch.__version__, "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
                "source_sha256": _source_digest(), "variants": [v.name for v in variants]}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return libraries


def prebuilt_library(directory: Path | None = None, flags: frozenset[str] | None = None) -> BuildResult | None:
    """The prebuilt library for this CPU (default: in the package's prebuilt/), or None (said in a
    debug line) where there is none for this torch, this source or this CPU."""
    directory = directory or PREBUILT_DIR
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if (manifest.get("torch"), manifest.get("source_sha256")) != (torch.__version__, _source_digest()):
        logger.debug("prebuilt CPU kernels in %s are for torch %s and another source revision; not used",
                     directory, manifest.get("torch"))
        return None
    variant = pick_variant(cpu_flags() if flags is None else flags, manifest.get("variants", []))
    if variant is None:
        logger.debug("no prebuilt CPU kernel in %s fits this CPU's instruction set", directory)
        return None
    library = directory / f"{SOURCE.stem}-{variant.name}.so"
    return BuildResult(library, compiled=False, seconds=0.0, variant=variant.name) if library.is_file() else None


def load_library(cache_dir: Path | None = None, compiler: str | None = None) -> BuildResult:
    """Loads the kernel as torch.ops.kvserve_cpu.paged_attention: the prebuilt library for this
    CPU where the package has one, else one built for this machine (once per machine)."""
    prebuilt = prebuilt_library()
    if prebuilt is not None:
        try:
            torch.ops.load_library(str(prebuilt.library))
            return prebuilt
        except OSError as error:  # e.g. a library the dynamic loader rejects; compiling may still work
            logger.warning("could not load the prebuilt CPU kernel %s (%s); building one for this machine",
                           prebuilt.library, error)
    result = build_library(cache_dir or default_cache_dir(), compiler)
    try:
        torch.ops.load_library(str(result.library))
    except OSError as error:
        raise KernelBuildError(f"could not load {result.library}: {error}") from error
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compile the CPU attention kernel ahead of time, one library per "
                                                 "instruction-set family (the container image does this).")
    parser.add_argument("command", choices=["prebuild"])
    parser.add_argument("--out", type=Path, help=f"default: {PREBUILT_DIR}")
    parser.add_argument("--variants", default=",".join(v.name for v in ISA_VARIANTS))
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = set(names) - {v.name for v in ISA_VARIANTS}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {','.join(v.name for v in ISA_VARIANTS)}")
    started = time.perf_counter()
    try:
        libraries = prebuild(args.out, variants=[v for v in ISA_VARIANTS if v.name in names])
    except KernelBuildError as error:
        parser.exit(1, f"error: {error}\n")
    print(f"built {', '.join(str(p) for p in libraries)} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
