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
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_attention.cpp"
COMPILE_TIMEOUT_S = 600
TORCH_DIR = Path(torch.__file__).parent
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
# Headers a compile against torch reads, relative to torch/include: the kernel's registration
# header, and the prefix of every C++ file torch.compile generates for the CPU. Images that strip
# torch's headers to save space (62 MB) keep the compiler's check from meaning anything alone.
TORCH_HEADERS = ("torch/library.h", "torch/csrc/inductor/cpp_prefix.h")


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded here (no compiler, compile error, ...)."""


@dataclass(frozen=True)
class BuildResult:
    library: Path
    compiled: bool  # False: an earlier process's build was reused
    seconds: float  # compile (or lookup) plus load time


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


def _command(compiler: str, output: Path, source: Path = SOURCE) -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
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
        logger.info("compiling the CPU attention kernel into %s (once per machine)", cache_dir)
        partial = library.with_suffix(f".{os.getpid()}.partial")
        result = subprocess.run(_command(compiler, partial, source), capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise KernelBuildError(f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(partial, library)
    return BuildResult(library, compiled=True, seconds=time.perf_counter() - started)


def load_library(cache_dir: Path | None = None, compiler: str | None = None) -> BuildResult:
    """Builds (once per machine) and loads the kernel as torch.ops.kvserve_cpu.paged_attention."""
    result = build_library(cache_dir or default_cache_dir(), compiler)
    try:
        torch.ops.load_library(str(result.library))
    except OSError as error:
        raise KernelBuildError(f"could not load {result.library}: {error}") from error
    return result
