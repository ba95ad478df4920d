"""Hugging Face safetensors checkpoints (single file or sharded), read tensor by tensor.

`get_slice` reads only the requested rows or columns from the memory-mapped file, so a
tensor-parallel rank never holds a whole tensor it keeps a slice of.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvserve.engine.model.checkpoint import missing
from kvserve.engine.model.model_errors import CorruptModelError, ModelNotFoundError

INDEX_FILE = "model.safetensors.index.json"
# Old checkpoints saved derived buffers; we recompute them from the config.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CorruptModelError(f"{index} is not a valid safetensors index ({exc}); re-download the model") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CorruptModelError(f"{model_dir}: shards {', '.join(absent)} listed in {INDEX_FILE} are missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{model_dir} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files


def _unreadable(file: Path, exc: Exception) -> CorruptModelError:
    return CorruptModelError(f"{file} cannot be read ({type(exc).__name__}: {exc}); re-download it")


class SafetensorsCheckpoint:
    """Open while its `with` block runs (the files stay memory-mapped until then)."""

    def __init__(self, model_dir: Path) -> None:
        self.where = str(model_dir)
        self._model_dir = model_dir
        self._stack = ExitStack()
        self._tensors: dict[str, tuple[Any, Path]] = {}  # name -> (open file, its path)

    def __enter__(self) -> "SafetensorsCheckpoint":
        try:
            for file in safetensors_files(self._model_dir):
                try:
                    handle = self._stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                    names = list(handle.keys())
                except Exception as exc:  # safetensors raises its own error types for bad headers/truncation
                    raise _unreadable(file, exc) from exc
                self._tensors |= {name: (handle, file) for name in names if not name.endswith(IGNORED_SUFFIXES)}
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def names(self) -> frozenset[str]:
        return frozenset(self._tensors)

    def _slice(self, name: str) -> tuple[Any, Path]:
        if name not in self._tensors:
            raise CorruptModelError(missing(self.where, name))
        handle, file = self._tensors[name]
        try:
            return handle.get_slice(name), file
        except Exception as exc:
            raise _unreadable(file, exc) from exc

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name)[0].get_shape())

    def read(self, name: str, dim: int | None, start: int, stop: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        view, file = self._slice(name)
        try:
            tensor = view[:] if dim is None else view[start:stop] if dim == 0 else view[:, start:stop]
        except Exception as exc:
            raise _unreadable(file, exc) from exc
        return tensor.to(device=device, dtype=dtype)
