"""Where the model runs and in which precision, resolved from the user's "auto" settings."""

from __future__ import annotations

import torch

from kvserve.engine.config import ConfigError, EngineConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Measured on the 2-core AVX-512/AMX CPU (benchmarks/dtype_cpu.py): see README "Precision".
CPU_DEFAULT_DTYPE = torch.bfloat16


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"--device {config.device} was asked for, but CUDA is not available here")
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else CPU_DEFAULT_DTYPE
    dtype = _DTYPES[config.dtype]
    if device.type == "cpu" and dtype is torch.float16:
        raise ConfigError("--dtype", "float16 is not supported on CPU; use float32 or bfloat16")
    return dtype
