"""Where the model runs and in which precision, resolved from the user's "auto" settings."""

from __future__ import annotations

import logging
import platform

import torch

from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.kernels.cpu_bf16_gemm import REQUIRED_CPU_FLAGS as BF16_KERNEL_CPU_FLAGS
from kvserve.kernels.cpu_bf16_gemm import bf16_gemm_available, native_bf16_arithmetic
from kvserve.kernels.cpu_kernel_build import cpu_flags

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# On x86 CPUs without bf16 arithmetic (native_bf16_arithmetic) oneDNN widens every bf16 operand to
# float32 in software: measured on a 2-core AVX2-only AMD EPYC (Zen 2), a 32-row decode step took
# 752.7 ms in bfloat16 against 249.6 ms in float32 (benchmarks/dtype_cpu.py), while on AVX-512
# BF16 / AMX CPUs bfloat16 is 1.7x faster (README "Precision"). On AVX-512 CPUs without BF16,
# kvserve's own bf16-weight kernel (kernels/cpu_bf16_gemm.py: pairs widened to fp32 in registers,
# fp32 FMAs) serves every bf16 layer instead of oneDNN, and there bfloat16 is the faster again
# (2-core Xeon, benchmarks/step_profile.py: decode steps of 1 / 16 / 64 rows 18.2 / 39.5 / 108.0 ms
# against float32's 34.0 / 60.9 / 141.0; W64 offline 1.22x). So `auto` picks per CPU.


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"--device {config.device} was asked for, but CUDA is not available here")
    return device


def cpu_default_dtype(flags: frozenset[str] | None = None, machine: str | None = None,
                      bf16_kernel: bool | None = None) -> torch.dtype:
    """bfloat16, except on an x86 CPU with neither bf16 arithmetic nor kvserve's bf16-weight kernel
    (AVX-512 and a compiler): there float32 is the faster of the two. `flags` of /proc/cpuinfo,
    `machine` and `bf16_kernel` (whether the kernel loads) stand for this CPU's in tests."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return torch.bfloat16
    flags = cpu_flags() if flags is None else flags
    if native_bf16_arithmetic(flags):
        return torch.bfloat16
    if bf16_kernel is None:
        bf16_kernel = BF16_KERNEL_CPU_FLAGS <= flags and bf16_gemm_available()
    return torch.bfloat16 if bf16_kernel else torch.float32


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        dtype = cpu_default_dtype()
        if dtype is torch.float32:
            logger.info("--dtype auto: float32, as this CPU has no bfloat16 arithmetic (AVX-512 BF16 or AMX), "
                        "which oneDNN emulates (3x slower on a Zen 2), and no AVX-512 for kvserve's bf16-weight "
                        "kernel; --dtype bfloat16 halves the weights' memory instead")
        elif not native_bf16_arithmetic(cpu_flags()):
            logger.info("--dtype auto: bfloat16 on kvserve's bf16-weight kernel (this CPU has no bfloat16 "
                        "arithmetic: AVX-512 BF16 or AMX; the kernel widens bf16 to float32 in registers)")
        return dtype
    dtype = _DTYPES[config.dtype]
    if device.type == "cpu" and dtype is torch.float16:
        raise ConfigError("--dtype", "float16 is not supported on CPU; use float32 or bfloat16")
    return dtype
