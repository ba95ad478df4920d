"""The gated MLP on kvserve's SiLU kernel: prepack routes every SiLU MLP of a CPU model to it (not
a GELU one); the routed forward computes what the compiled forward computes, bit for bit, for bf16
CPU activations, and keeps torch's path for float32 ones; once packed, gate_up's matmul and the SiLU
are one kernel call, with the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.model.gated_mlp import GatedMLP
from kvserve.engine.model import packed_linear as packed_linear_module
from kvserve.engine.model.gemma3 import gelu_tanh
from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.packed_linear import pack_linear_weights
from kvserve.engine.worker.model_preparation import prepack
from kvserve.kernels import cpu_bf16_gemm
from kvserve.kernels.cpu_bf16_gemm import bf16_gemm_available
from tests.engine.test_kv_memory import host
from tests.engine.test_model_runner import CONFIG

needs_kernel = pytest.mark.skipif(not bf16_gemm_available(), reason="no AVX-512 or no C++ compiler here")


def _mlp(activation=F.silu) -> GatedMLP:
    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, activation=activation)
    for parameter in mlp.parameters():
        nn.init.normal_(parameter, std=0.3)
    return mlp.eval()


def _unrouted_compiled(mlp: GatedMLP):
    """The forward as the compiled model ran it before: inductor's own SiLU x up kernel."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = mlp.gate_up_proj(x).split(mlp.intermediate_size, dim=-1)
        return mlp.down_proj(F.silu(gate) * up)
    return torch.compile(forward, dynamic=False)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_the_routed_mlp_computes_what_the_compiled_forward_computes(rows: int) -> None:
    mlp = _mlp().to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    with torch.no_grad():
        expected = _unrouted_compiled(mlp)(x)
        assert mlp.use_cpu_silu_kernel()
        assert torch.equal(mlp(x), expected)
        assert torch.equal(torch.compile(mlp, dynamic=False)(x), expected)


@needs_kernel
def test_the_routed_mlp_calls_the_kernel_for_bf16_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    kernel = cpu_bf16_gemm.silu_mul

    def spy(gate_up: torch.Tensor) -> torch.Tensor:
        calls.append(gate_up.dtype)
        return kernel(gate_up)

    monkeypatch.setattr("kvserve.engine.model.gated_mlp.silu_mul", spy)
    mlp = _mlp()
    assert mlp.use_cpu_silu_kernel()
    x = torch.randn(3, 64)
    with torch.no_grad():
        wide = mlp(x)  # float32: torch's path
        gate, up = mlp.gate_up_proj(x).split(96, dim=-1)
        assert torch.equal(wide, mlp.down_proj(F.silu(gate) * up))
        mlp.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert calls == [torch.bfloat16]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_a_packed_mlp_multiplies_gate_up_and_silu_in_one_call_with_the_same_bits(
        rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once prepacked, gate_up's matmul and silu(gate) * up are one kernel call (PackedLinear.silu_mul)
    where the kernel serves the rows, and the MLP still computes what the compiled forward computes."""
    mlp = _mlp().to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    calls: list[int] = []
    kernel = packed_linear_module.bf16_linear_silu_mul
    monkeypatch.setattr(packed_linear_module, "bf16_linear_silu_mul",
                        lambda x, packed, intermediate: calls.append(intermediate) or kernel(x, packed, intermediate))
    with torch.no_grad():
        expected = _unrouted_compiled(mlp)(x)
        assert pack_linear_weights(mlp, few_rows_kernel=True) == 2 and mlp.use_cpu_silu_kernel()
        assert torch.equal(mlp(x), expected)
    assert calls == ([96] if mlp.gate_up_proj._kernel_serves(x) else [])


def test_a_gelu_mlp_is_not_routed() -> None:
    mlp = _mlp(activation=gelu_tanh)
    assert not mlp.use_cpu_silu_kernel() and not mlp.cpu_silu_kernel


@needs_kernel
def test_prepack_routes_every_silu_mlp_of_a_cpu_model(tmp_path) -> None:
    model = LlamaForCausalLM(CONFIG).to(torch.bfloat16).eval()
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert len(mlps) == CONFIG.num_layers and not any(m.cpu_silu_kernel for m in mlps)
    prepack(model, torch.device("cpu"), 1 << 20, host(tmp_path, available=1 << 34))
    assert all(m.cpu_silu_kernel for m in mlps)


def test_prepack_leaves_a_model_on_another_device_alone() -> None:
    model = LlamaForCausalLM(CONFIG).to(torch.bfloat16).eval()
    assert prepack(model, torch.device("meta"), 1 << 20) == 0
    assert not any(m.cpu_silu_kernel for m in model.modules() if isinstance(m, GatedMLP))
