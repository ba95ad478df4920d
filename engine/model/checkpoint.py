"""A checkpoint as the loader reads it: tensors by their Hugging Face names, each read whole or
as one contiguous range of rows (dim 0) or columns (dim 1), so a tensor-parallel rank reads only
its slice. The formats (safetensors_checkpoint.py, gguf_checkpoint.py) implement this."""

from __future__ import annotations

from typing import Protocol

import torch


class Checkpoint(Protocol):
    where: str  # the file or folder, for error messages

    def names(self) -> frozenset[str]: ...

    def shape(self, name: str) -> tuple[int, ...]:
        """Raises CorruptModelError naming the tensor when the checkpoint lacks it."""

    def read(self, name: str, dim: int | None, start: int, stop: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """The whole tensor (dim None), or indices [start, stop) of dim 0 or 1, in `dtype` on `device`."""


def missing(where: str, name: str) -> str:
    return f"{where}: weight {name!r} is missing from the checkpoint"
