"""A checkpoint seen under other names: each name's first matching old prefix is rewritten to its
new one (transformers' checkpoint conversion mapping). Multimodal Gemma 3 checkpoints saved by
older transformers keep the text model under `language_model.model.`, newer ones under
`model.language_model.`; the family's layout names one spelling and this view serves both."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvserve.engine.model.checkpoint import Checkpoint, missing
from kvserve.engine.model.model_errors import CorruptModelError


class RenamedCheckpoint:
    def __init__(self, inner: Checkpoint, renames: Mapping[str, str]) -> None:
        self.where = inner.where
        self._inner = inner
        self._original: dict[str, str] = {}  # our name -> the checkpoint's
        for name in inner.names():
            new = next((to + name[len(old):] for old, to in renames.items() if name.startswith(old)), name)
            if new in self._original:
                raise CorruptModelError(f"{self.where}: both {self._original[new]!r} and {name!r} hold {new!r}")
            self._original[new] = name

    def names(self) -> frozenset[str]:
        return frozenset(self._original)

    def _name(self, name: str) -> str:
        if name not in self._original:
            raise CorruptModelError(missing(self.where, name))
        return self._original[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._inner.shape(self._name(name))

    def read(self, name: str, dim: int | None, start: int, stop: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        return self._inner.read(self._name(name), dim, start, stop, dtype, device)
