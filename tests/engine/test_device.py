"""`--dtype auto` on CPU: bfloat16 where the CPU multiplies it in hardware or where kvserve's
bf16-weight kernel runs (AVX-512 and a compiler), float32 elsewhere."""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.engine import device as device_module
from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.engine.device import cpu_default_dtype, resolve_dtype

CPU = torch.device("cpu")
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})  # Zen 2/3, Haswell to Comet Lake
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl"}  # Skylake-SP to Ice Lake: no bf16 arithmetic


@pytest.mark.parametrize("flags", [AVX512 | {"avx512_bf16"}, AVX512 | {"amx_bf16", "amx_tile"}])
def test_x86_with_bf16_arithmetic_picks_bfloat16(flags: frozenset[str]) -> None:
    assert cpu_default_dtype(flags, "x86_64") is torch.bfloat16


@pytest.mark.parametrize("flags", [AVX2_ONLY, AVX512, frozenset()])
def test_x86_without_it_or_the_bf16_kernel_picks_float32(flags: frozenset[str]) -> None:
    assert cpu_default_dtype(flags, "x86_64", bf16_kernel=False) is torch.float32


def test_avx512_without_bf16_arithmetic_picks_bfloat16_where_the_bf16_kernel_loads() -> None:
    assert cpu_default_dtype(AVX512, "x86_64", bf16_kernel=True) is torch.bfloat16
    # The kernel needs AVX-512: an AVX2 CPU is never asked to build it.
    assert cpu_default_dtype(AVX2_ONLY, "x86_64") is torch.float32


def test_other_architectures_keep_bfloat16() -> None:
    # aarch64's flags ("Features") name no x86 extension: the rule is for x86 only.
    assert cpu_default_dtype(frozenset({"fp", "asimd", "bf16"}), "aarch64") is torch.bfloat16


def test_auto_follows_this_cpu_and_says_so_when_it_is_float32(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(device_module, "cpu_flags", lambda: AVX2_ONLY)
    monkeypatch.setattr(device_module.platform, "machine", lambda: "x86_64")
    with caplog.at_level(logging.INFO, logger="kvserve.engine.device"):
        assert resolve_dtype(EngineConfig(), CPU) is torch.float32
    assert "no bfloat16 arithmetic" in caplog.text
    monkeypatch.setattr(device_module, "cpu_flags", lambda: AVX512 | {"avx512_bf16"})
    assert resolve_dtype(EngineConfig(), CPU) is torch.bfloat16
    caplog.clear()
    monkeypatch.setattr(device_module, "cpu_flags", lambda: AVX512)
    monkeypatch.setattr(device_module, "bf16_gemm_available", lambda: True)
    with caplog.at_level(logging.INFO, logger="kvserve.engine.device"):
        assert resolve_dtype(EngineConfig(), CPU) is torch.bfloat16
    assert "bfloat16 on kvserve's bf16-weight kernel" in caplog.text
    monkeypatch.setattr(device_module, "bf16_gemm_available", lambda: False)  # e.g. no compiler
    assert resolve_dtype(EngineConfig(), CPU) is torch.float32


def test_an_explicit_dtype_is_kept_whatever_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "cpu_flags", lambda: AVX2_ONLY)
    assert resolve_dtype(EngineConfig(dtype="bfloat16"), CPU) is torch.bfloat16
    assert resolve_dtype(EngineConfig(dtype="float32"), CPU) is torch.float32
    with pytest.raises(ConfigError, match="float16 is not supported on CPU"):
        resolve_dtype(EngineConfig(dtype="float16"), CPU)
