"""Errors raised while finding, reading or building a model. Each message tells the user what to do."""

from __future__ import annotations

from collections.abc import Sequence


class ModelNotFoundError(FileNotFoundError):
    """`--model` names nothing we can load: no such file/directory, or the default model is not
    installed and cannot be downloaded."""


class CorruptModelError(ValueError):
    """A model file exists but cannot be read: truncated, bad magic, tensors of the wrong shape,
    non-finite weights."""


class UnsupportedArchitectureError(ValueError):
    """The checkpoint is a model family kvserve does not implement."""

    def __init__(self, architecture: str, where: str, supported: Sequence[str], spelled: Sequence[str] = ()) -> None:
        """supported: the registry's architecture names; spelled: how `where` spells them
        (config.json's class names), when it spells them differently."""
        also = f" (in config.json: {', '.join(spelled)})" if spelled else ""
        super().__init__(f"{where}: architecture {architecture!r} is not supported; kvserve runs "
                         f"{', '.join(supported)}{also}")
        self.architecture = architecture


class ModelConfigError(ValueError):
    """A model's configuration is inconsistent or uses a feature kvserve does not implement."""
