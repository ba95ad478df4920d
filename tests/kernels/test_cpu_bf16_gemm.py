"""kvserve's few-row bf16 linear: packing round-trips; the op matches the float32 product of the
same bf16 values within bf16's rounding on SmolLM2's shapes, odd N and K, 1..9 rows and the edges of
the AMX paths' row blocks (16, 17, 31-33, 64, 100, 128, 257 and 300: past a 256-row chunk), with and
without bias; the build for AVX-512 CPUs without BF16 (its own route: pairs widened to fp32, its own
rounding) does the same where this CPU has BF16 too; it stays one node under torch.compile; where the CPU lacks the
instructions or the build fails, one log line and False, never an exception. The row argmax follows
argmax's rules, and the linear's argmax without its output is that of its output (ties, NaN, +-inf,
bf16 rounding, partial tiles, channels over threads); silu_mul is the compiled forward's silu(gate) * up
bit for bit, and the linear with silu_mul in its passes is silu_mul of the linear's output, bit for bit."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import cpu_kernel_build
from kvserve.kernels.cpu_bf16_gemm import (SOURCE, bf16_gemm_available, bf16_linear, bf16_linear_argmax, bf16_row_argmax,
                                           bf16_linear_silu_mul, load_bf16_gemm, pack_bf16, silu_mul, unpack_bf16)

REPO = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(not bf16_gemm_available(), reason="no AVX-512 or no C++ compiler here")
# SmolLM2-135M's fused qkv, o, gate_up, down and lm_head (N x K), then odd ones (a partial tile, an odd K,
# K % 32 != 0: the vector loop at every row count; 17 x 64: AMX's partial tile where the CPU has AMX;
# 48 x 64: three channel tiles, so the 32-row blocks' last channel pair has one tile).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (17, 9), (40, 33), (1, 2),
          (17, 64), (48, 64)]
ROWS = [*range(1, 10), 16, 17, 31, 32, 33, 64, 100, 128, 257, 300]
# Gated MLPs' (K, intermediate): SmolLM2-135M's, one gate tile, an odd K, five gate tiles (the threads'
# and passes' groups end on a partial one).
GATED_SHAPES = [(576, 1536), (64, 16), (33, 48), (64, 80)]


def _case(n: int, k: int, rows: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    b = torch.randn(n, generator=generator).to(torch.bfloat16) if bias else None
    return weight, x, b


def _check(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    # fp32 sums in another order, one rounding to bf16 (8 bits: 2^-8 relative) at the end.
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-3 * (1 + expected.abs().max().item()))


def test_packing_round_trips_with_zero_padding() -> None:
    weight = torch.randn(17, 9).to(torch.bfloat16)
    packed = pack_bf16(weight)
    assert packed.shape == (2, 5, 16, 2) and packed.dtype == torch.bfloat16
    assert torch.equal(unpack_bf16(packed, 17, 9), weight)
    assert packed.float().abs().sum() == weight.float().abs().sum()  # the padding is zeros


@needs_kernel
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_float32_product(n: int, k: int, bias: bool) -> None:
    rows_tried = ROWS if n * k <= 3072 * 576 else [1, 4, 9, 33, 128]  # lm_head: a few, for time
    for rows in rows_tried:
        weight, x, b = _case(n, k, rows, bias, seed=rows)
        _check(bf16_linear(x, pack_bf16(weight), b, n), x, weight, b)


@needs_kernel
def test_leading_dimensions_zero_rows_and_bad_input() -> None:
    weight, x, b = _case(40, 33, 6, bias=True)
    packed = pack_bf16(weight)
    out = bf16_linear(x.reshape(2, 3, 33), packed, b, 40)
    assert out.shape == (2, 3, 40)
    _check(out.reshape(6, 40), x, weight, b)
    assert bf16_linear(x[:0], packed, b, 40).shape == (0, 40)
    with pytest.raises(ValueError, match="K = 32"):
        bf16_linear(x[:, :32], packed, b, 40)
    with pytest.raises(ValueError, match="bfloat16"):
        bf16_linear(x.float(), packed, b, 40)
    with pytest.raises(ValueError, match="out_features 64"):
        bf16_linear(x, packed, None, 64)
    with pytest.raises(ValueError, match="bias must be"):
        bf16_linear(x, packed, b[:3], 40)


@needs_kernel
def test_one_graph_node_under_torch_compile() -> None:
    weight, _, b = _case(96, 64, 1, bias=True)
    packed = pack_bf16(weight)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.silu(bf16_linear(x * 2, packed, b, 96))

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(forward, backend=backend, dynamic=True, fullgraph=True)
    for rows in (2, 5):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(compiled(x), forward(x))
    assert not torch._dynamo.utils.counters["graph_break"]
    calls = [node for node in graphs[-1].graph.nodes if "kvserve_bf16.bf16_linear" in str(node.target)]
    assert len(calls) == 1


def test_a_cpu_without_avx512_uses_onednn_after_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.kernels"):
        assert load_bf16_gemm(tmp_path, flags=frozenset({"avx2", "fma", "avx512f"})) is False
    assert len(caplog.records) == 1 and "lacks avx512bw" in caplog.records[0].getMessage()
    assert not list(tmp_path.iterdir())  # nothing was built


def test_a_failed_build_uses_onednn_after_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flags = frozenset({"avx512f", "avx512bw"})
    with caplog.at_level(logging.INFO, logger="kvserve.kernels"):
        assert load_bf16_gemm(tmp_path, compiler="no-such-c++-compiler", flags=flags) is False
    assert len(caplog.records) == 1 and "oneDNN at every row count: no C++ compiler" in caplog.records[0].getMessage()


CHECK_WITHOUT_BF16 = """
import sys
import torch
torch.ops.load_library(sys.argv[1])
from kvserve.kernels import cpu_bf16_gemm
from kvserve.kernels.cpu_bf16_gemm import pack_bf16
cpu_bf16_gemm.bf16_gemm_available = lambda: True  # the build above serves: the test module must not load another
from tests.kernels.test_cpu_bf16_gemm import GATED_SHAPES, ROWS, _case, _check
for n, k in [(960, 576), (17, 9), (40, 33), (48, 64)]:
    for rows in ROWS:
        weight, x, b = _case(n, k, rows, bias=rows % 2 == 0, seed=rows)
        _check(torch.ops.kvserve_bf16.bf16_linear(x, pack_bf16(weight), b, n), x, weight, b)
for k, intermediate in GATED_SHAPES:  # the gated passes of this route: silu_mul of its own linear, bit for bit
    weight, _, _ = _case(2 * intermediate, k, 1, bias=False)
    packed = pack_bf16(weight)
    for rows in ROWS:
        _, x, _ = _case(2 * intermediate, k, rows, bias=False, seed=rows)
        gate_up = torch.ops.kvserve_bf16.bf16_linear(x, packed, None, 2 * intermediate)
        fused = torch.ops.kvserve_bf16.bf16_linear_silu_mul(x, packed, intermediate)
        assert torch.equal(fused.view(torch.int16), torch.ops.kvserve_bf16.silu_mul(gate_up).view(torch.int16)), (k, rows)
# NaN stays NaN through the rounding without BF16's instruction; halfway cases round to even.
weight = torch.ones(16, 2, dtype=torch.bfloat16)
x = torch.tensor([[float("nan"), 0.0], [1.0, 2.0**-8], [1.0 + 2.0**-7, 2.0**-8]]).to(torch.bfloat16)
out = torch.ops.kvserve_bf16.bf16_linear(x, pack_bf16(weight), None, 16)
assert out[0].isnan().all() and (out[1] == 1.0).all() and (out[2] == 1.0 + 2.0**-6).all(), out[:, 0]
print("without bf16 ok")
"""


@pytest.mark.slow
def test_the_build_for_avx512_without_bf16_matches_the_float32_product_too(tmp_path: Path) -> None:
    # x86-64-v4 (AVX-512 F/BW/CD/DQ/VL, no BF16): Skylake-SP to Ice Lake, and CPUs whose hypervisor
    # hides BF16. Built here whatever this CPU has, so its route for bf16 activations (widened to
    # fp32, rounded without vcvtneps2bf16) runs on BF16 and AMX machines too; in a subprocess, as
    # this process may already hold the native build under the same op names.
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if not {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= cpu_kernel_build.cpu_flags():
        pytest.skip("this CPU cannot run an x86-64-v4 build")
    library = tmp_path / "cpu_bf16_gemm-x86-64-v4.so"
    build = subprocess.run(cpu_kernel_build._command("c++", library, SOURCE, ("-march=x86-64-v4",)),
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", CHECK_WITHOUT_BF16, str(library)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "without bf16 ok" in done.stdout, done.stdout + done.stderr


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152])
def test_row_argmax_follows_argmax_rules(vocab: int) -> None:
    """torch.argmax's answers on bf16 logits: the first maximum (ties within and across 16-entry
    vectors, and in the tail past the last full vector; -0.0 equals 0.0), a NaN as the maximum
    (the first one, also after a larger value or in the tail), an all -inf row gives 0."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, vocab, generator=generator)
    last = vocab - 1
    logits[0, [last, 0]] = 50.0
    logits[1, [last, min(3, last)]] = float("nan")
    logits[2] = float("-inf")
    logits[3] = 0.0
    logits[3, last] = -0.0
    logits[4, last] = float("inf")
    logits[5, 0] = 60.0
    logits[5, last] = float("nan")
    logits[6] = -0.0
    logits[6, last] = 0.0
    logits[7, last // 2] = 1e30
    logits[8] = float("-inf")
    logits[8, last] = -1e30
    half = logits.bfloat16()
    assert bf16_row_argmax(half).tolist() == half.argmax(dim=-1).tolist()
    assert bf16_row_argmax(half[:1]).tolist() == half[:1].argmax(dim=-1).tolist()
    assert bf16_row_argmax(half[:0]).tolist() == []
    many = torch.randn(67, vocab, generator=generator).bfloat16()  # rows split over threads
    assert torch.equal(bf16_row_argmax(many), many.argmax(dim=-1))


@needs_kernel
@pytest.mark.parametrize("n, k", [(49152, 576), (17, 64), (48, 64), (40, 33), (1000, 63)])
@pytest.mark.parametrize("rows", [1, 4, 5, 16, 17, 33, 64, 100, 300])
def test_linear_argmax_is_the_argmax_of_the_linears_output(n: int, k: int, rows: int) -> None:
    weight, x, _ = _case(n, k, rows, bias=False)
    packed = pack_bf16(weight)
    expected = bf16_linear(x, packed, None, n).argmax(dim=-1)
    assert torch.equal(bf16_linear_argmax(x, packed, n), expected)
    assert torch.equal(bf16_linear_argmax(x.view(rows, 1, k), packed, n), expected)  # rows of any leading shape


@needs_kernel
@pytest.mark.parametrize("rows", [8, 40])
def test_linear_argmax_follows_argmax_rules(rows: int) -> None:
    """One-hot rows read one weight column each (logits[r, c] = weight[c, j]); a few rows are set
    by hand. 4,099 channels: a partial last tile, and both threads' shares."""
    n, k = 4099, 64
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=generator) * 0.01
    x = torch.zeros(rows, k)
    x[torch.arange(rows), 16 + torch.arange(rows) % 48] = 1.0
    weight[[3, 4000], 16] = 5.0  # row 0: a tie far apart -> the first
    weight[4098, 17] = 7.0  # row 1: the last channel
    x[2] = 0.0  # row 2: all zeros -> 0
    x[3], x[3, 0], weight[:, 0] = 0.0, float("-inf"), 1.0  # row 3: all -inf -> 0
    x[4], x[4, 1], weight[:, 1] = 0.0, float("inf"), -1.0  # row 4: -inf but +inf at 77
    weight[77, 1] = 1.0
    x[5], x[5, 2] = 0.0, float("nan")  # row 5: all NaN -> 0
    # row 6: 1 + 2^-9 rounds to bf16's 1.0, a tie with channel 100's exact 1.0 -> 100
    x[6], x[6, 3], x[6, 4] = 0.0, 1.0, 2.0**-9
    weight[:, 3:5] = 0.0
    weight[100, 3] = weight[2000, 3] = weight[2000, 4] = 1.0
    weight, x = weight.to(torch.bfloat16), x.to(torch.bfloat16)
    packed = pack_bf16(weight)
    expected = bf16_linear(x, packed, None, n).argmax(dim=-1)
    assert expected[:7].tolist() == [3, 4098, 0, 0, 77, 0, 100]
    assert torch.equal(bf16_linear_argmax(x, packed, n), expected)
    # A NaN channel every row reads (0 x NaN is NaN too), after larger values: the first NaN wins.
    weight[2500, 20] = float("nan")
    random_rows = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    packed = pack_bf16(weight)
    expected = bf16_linear(random_rows, packed, None, n).argmax(dim=-1)
    assert set(expected.tolist()) == {2500}
    assert torch.equal(bf16_linear_argmax(random_rows, packed, n), expected)


@needs_kernel
def test_row_argmax_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="contiguous, non-empty"):
        bf16_row_argmax(torch.zeros(2, 8))  # float32
    with pytest.raises(ValueError, match="contiguous, non-empty"):
        bf16_row_argmax(torch.zeros(8, 2, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="contiguous, non-empty"):
        bf16_row_argmax(torch.zeros(2, 0, dtype=torch.bfloat16))


def _silu_times_up(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bf16 bit patterns, any NaN equal to any NaN (their payloads carry nothing)."""
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())).all())


@needs_kernel
def test_silu_mul_is_the_compiled_forwards_silu_times_up_bit_for_bit() -> None:
    """Every one of bf16's 65,536 gate values (subnormals, infinities and NaNs included) against
    random ups: the fp32 formula the compiled forward's kernel evaluates, and that kernel itself."""
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ups = torch.randn(65536, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    gate_up = torch.cat([gates, ups]).view(1, -1)
    out = silu_mul(gate_up)
    wide = gates.float()
    assert _same_bits(out[0], (wide / (torch.exp(-wide) + 1) * ups.float()).to(torch.bfloat16))
    assert _same_bits(out, torch.compile(_silu_times_up, dynamic=False)(gate_up))
    # Rounded to bf16 once, after the product: not the eager bf16 path, which rounds silu first.
    assert not _same_bits(out[0], F.silu(gates) * ups)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 2), (3, 30), (1, 32), (5, 34), (64, 3072), (2, 3, 66), (0, 3072), (1889, 3072)])
def test_silu_mul_takes_any_width_and_leading_dimensions(shape: tuple[int, ...]) -> None:
    gate_up = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    out = silu_mul(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == torch.bfloat16
    wide = gate_up.float()
    gate, up = wide.split(shape[-1] // 2, dim=-1)
    assert _same_bits(out, (gate / (torch.exp(-gate) + 1) * up).to(torch.bfloat16))
    # A strided view of the same values (rows further apart than their width) gives the same answer.
    strided = torch.cat([gate_up, gate_up[..., :2]], dim=-1)[..., :shape[-1]]
    assert _same_bits(silu_mul(strided), out)


@needs_kernel
def test_silu_mul_is_one_graph_node_under_torch_compile_at_any_row_count() -> None:
    compiled = torch.compile(silu_mul, dynamic=True, fullgraph=True)
    for rows in (1, 7, 64):
        gate_up = torch.randn(rows, 96).to(torch.bfloat16)
        assert _same_bits(compiled(gate_up), silu_mul(gate_up))


@needs_kernel
def test_silu_mul_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="bfloat16 CPU tensor"):
        silu_mul(torch.zeros(2, 8))  # float32
    with pytest.raises(ValueError, match="even"):
        silu_mul(torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even"):
        silu_mul(torch.tensor(1.0, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize(("k", "intermediate"), GATED_SHAPES)
def test_linear_silu_mul_is_silu_mul_of_the_linears_output_bit_for_bit(k: int, intermediate: int) -> None:
    weight, _, _ = _case(2 * intermediate, k, 1, bias=False)
    packed = pack_bf16(weight)
    for rows in ROWS:
        _, x, _ = _case(2 * intermediate, k, rows, bias=False, seed=rows)
        x = x * 4  # gates well into SiLU's curve on both sides, not only near 0
        expected = silu_mul(bf16_linear(x, packed, None, 2 * intermediate))
        out = bf16_linear_silu_mul(x, packed, intermediate)
        assert out.shape == (rows, intermediate) and out.dtype == torch.bfloat16
        assert _same_bits(out, expected), rows


@needs_kernel
def test_linear_silu_mul_takes_leading_dimensions_zero_rows_and_graphs() -> None:
    weight, x, _ = _case(96, 64, 6, bias=False)
    packed = pack_bf16(weight)
    expected = silu_mul(bf16_linear(x, packed, None, 96))
    assert _same_bits(bf16_linear_silu_mul(x.view(2, 3, 64), packed, 48), expected.view(2, 3, 48))
    assert bf16_linear_silu_mul(x[:0], packed, 48).shape == (0, 48)
    compiled = torch.compile(bf16_linear_silu_mul, dynamic=True, fullgraph=True)
    for rows in (1, 5, 6):
        assert _same_bits(compiled(x[:rows], packed, 48), expected[:rows])


@needs_kernel
def test_linear_silu_mul_refuses_what_it_cannot_pair() -> None:
    weight, x, _ = _case(96, 64, 2, bias=False)
    packed = pack_bf16(weight)
    with pytest.raises(ValueError, match="multiple of 16"):
        bf16_linear_silu_mul(x, pack_bf16(torch.zeros(40, 64, dtype=torch.bfloat16)), 20)
    with pytest.raises(ValueError, match="tiles"):
        bf16_linear_silu_mul(x, packed, 32)  # 6 tiles hold 2 x 48 channels, not 2 x 32
    with pytest.raises(ValueError, match="K = 63"):
        bf16_linear_silu_mul(x[:, :63], pack_bf16(torch.zeros(96, 66, dtype=torch.bfloat16)), 48)
