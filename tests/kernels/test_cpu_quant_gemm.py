"""The VNNI int4 and int8 kernels: packing round-trips; the products match float references (the
dequantized weights times the activations, exactly-quantized activations tighter) on SmolLM2's
layer shapes at 1..8 and 64 rows; they stay one node under torch.compile; where the CPU lacks the
instructions or the build fails, one log line and False, never an exception."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvserve.engine.quantization.int4_linear import quantize_int4
from kvserve.engine.quantization.int8_linear import quantize_int8
from kvserve.kernels.cpu_quant_gemm import (GROUP, int4_gemm, int8_gemm, load_quant_gemm, pack_int4, pack_int8,
                                            quant_gemm_available, unpack_int4, unpack_int8)

needs_kernel = pytest.mark.skipif(not quant_gemm_available(), reason="no AVX-512 VNNI or no C++ compiler here")
# SmolLM2-135M's fused qkv, o, gate_up and down (N x K).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, float32 dequantized [N, K])."""
    generator = torch.Generator().manual_seed(seed)
    q, scale, zero = quantize_int4(torch.randn(n, k, generator=generator) * 0.05)
    minimum = zero - 8 * scale
    # The kernel stores scales and minima in fp16: the reference uses the same rounded values.
    scale, minimum = scale.half().float(), minimum.half().float()
    reference = (q.float().reshape(n, -1, GROUP) * scale[..., None] + minimum[..., None]).reshape(n, k)
    return pack_int4(q, scale, minimum), reference


def _int8_groups(x: torch.Tensor) -> torch.Tensor:
    """x with each group of 32 rounded as the kernel rounds it (int8, scale amax / 127)."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # the kernel's x * (127 / amax)
    return (torch.round(groups * inverse) * (amax / 127)).reshape(x.shape)


def test_packing_round_trips() -> None:
    packed, reference = _weights(48, 96)
    assert packed.shape == (3, 3, 320) and packed.dtype == torch.uint8
    torch.testing.assert_close(unpack_int4(packed), reference, rtol=0, atol=0)


def test_int8_packing_round_trips() -> None:
    q, scale = quantize_int8(torch.randn(48, 96))
    packed = pack_int8(q, scale)
    assert packed.shape == (3, 3 * 512 + 64) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int8(packed), q)
    assert torch.equal(packed[:, -64:].contiguous().view(torch.float32).reshape(-1), scale)


def test_packing_refuses_shapes_the_kernel_cannot_run() -> None:
    q, scale, zero = quantize_int4(torch.randn(24, 64))  # 24 channels: not whole tiles of 16
    with pytest.raises(ValueError, match="N % 16 == 0"):
        pack_int4(q, scale, zero)


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 64])
def test_matches_the_float_product(n: int, k: int, rows: int) -> None:
    packed, reference = _weights(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 1))
    out = int4_gemm(x, packed)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # Against activations rounded as the kernel rounds them, only float summation order differs.
    torch.testing.assert_close(out, _int8_groups(x) @ reference.t(), rtol=1e-4, atol=1e-4)
    # Against the unrounded product: the int8 activations' error, ~0.5% of the output's scale.
    exact = x @ reference.t()
    assert (out - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_kernel
@pytest.mark.parametrize("n,k", [*SHAPES, (49152, 576)])  # the last: SmolLM2's output layer
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 64])
def test_int8_matches_the_float_product(n: int, k: int, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    q, scale = quantize_int8(torch.randn(n, k, generator=generator) * 0.05)
    reference = q.float() * scale[:, None]
    x = torch.randn(rows, k, generator=generator)
    out = int8_gemm(x, pack_int8(q, scale))
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, _int8_groups(x) @ reference.t(), rtol=1e-4, atol=1e-4)
    exact = x @ reference.t()
    assert (out - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations_give_their_own_dtype(dtype: torch.dtype) -> None:
    packed, reference = _weights(96, 64)
    x = torch.randn(3, 64).to(dtype)
    out = int4_gemm(x, packed)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _int8_groups(x) @ reference.t(), rtol=2e-2, atol=2e-2)


@needs_kernel
def test_zero_rows_all_zero_groups_and_bad_input() -> None:
    packed, _ = _weights(32, 64)
    assert int4_gemm(torch.empty(0, 64), packed).shape == (0, 32)
    with pytest.raises(ValueError, match="int8 gemm: packed weights must be"):
        int8_gemm(torch.randn(1, 64), packed)
    torch.testing.assert_close(int4_gemm(torch.zeros(2, 64), packed), torch.zeros(2, 32))
    with pytest.raises(ValueError, match="K = 96"):
        int4_gemm(torch.randn(1, 96), packed)
    with pytest.raises(ValueError, match="int32|float32, bfloat16 or float16"):
        int4_gemm(torch.randn(1, 64).double(), packed)


@needs_kernel
def test_one_graph_node_under_torch_compile() -> None:
    packed, reference = _weights(64, 64)

    q8, scale8 = quantize_int8(reference)
    packed8 = pack_int8(q8, scale8)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(int8_gemm(int4_gemm(x * 2, packed), packed8))

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(forward, dynamic=True, fullgraph=True)
    for rows in (1, 5):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x), forward(x), rtol=1e-5, atol=1e-5)
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_cpu_without_vnni_uses_torch_after_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.kernels"):
        assert load_quant_gemm(tmp_path, flags=frozenset({"avx2", "avx512f"})) is False
    assert len(caplog.records) == 1 and "lacks avx512_vnni, avx512bw" in caplog.records[0].getMessage()
    assert not list(tmp_path.iterdir())  # nothing was built


def test_a_failed_build_uses_torch_after_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flags = frozenset({"avx512f", "avx512bw", "avx512_vnni"})
    with caplog.at_level(logging.INFO, logger="kvserve.kernels"):
        assert load_quant_gemm(tmp_path, compiler="no-such-c++-compiler", flags=flags) is False
    assert len(caplog.records) == 1 and "use torch's ops: no C++ compiler" in caplog.records[0].getMessage()
