"""Where the model runs and in which precision, resolved from the user's "auto" settings."""

from __future__ import annotations

import logging
import platform

import torch

from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.kernels.cpu_kernel_build import cpu_flags

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# x86 CPUs that multiply bfloat16 in hardware (AVX-512 BF16's vdpbf16ps, AMX's tiles). Without
# them oneDNN widens every bf16 operand to float32 in software: measured on a 2-core AVX2-only
# AMD EPYC (Zen 2), a 32-row decode step took 752.7 ms in bfloat16 against 249.6 ms in float32
# (benchmarks/dtype_cpu.py), while on AVX-512 BF16 / AMX CPUs bfloat16 is 1.7x faster (README
# "Precision"). So `auto` picks per CPU.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"--device {config.device} was asked for, but CUDA is not available here")
    return device


def cpu_default_dtype(flags: frozenset[str] | None = None, machine: str | None = None) -> torch.dtype:
    """bfloat16, except on an x86 CPU without bf16 arithmetic (`flags` of /proc/cpuinfo and
    `machine` stand for this CPU's in tests): there float32 is the faster of the two."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return torch.bfloat16
    return torch.bfloat16 if NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags) else torch.float32


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        dtype = cpu_default_dtype()
        if dtype is torch.float32:
            logger.info("--dtype auto: float32, as this CPU has no bfloat16 arithmetic (AVX-512 BF16 or AMX), "
                        "which oneDNN emulates (3x slower on a Zen 2); --dtype bfloat16 halves the weights' memory instead")
        return dtype
    dtype = _DTYPES[config.dtype]
    if device.type == "cpu" and dtype is torch.float16:
        raise ConfigError("--dtype", "float16 is not supported on CPU; use float32 or bfloat16")
    return dtype
