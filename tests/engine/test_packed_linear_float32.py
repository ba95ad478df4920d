"""float32 weights are packed for oneDNN only when asked (`--dtype auto` chose float32 for speed):
the packed layers compute F.linear's sums in another order, so a packed model samples what the
dense one samples; the worker asks for it under `auto` only, so `--dtype float32` keeps MKL's
sgemm, which is what transformers runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.model.packed_linear import PackedLinear, pack_linear_weights, weight_packing_supported
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.worker.kv_cache_sizing import kv_cache_config_for
from kvserve.engine.worker.model_preparation import prepack
from kvserve.kernels import TorchAttentionBackend
from tests.engine.test_model_runner import CONFIG, PLAN, fresh_seqs, run_steps
from tests.engine.test_packed_linear import _model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not weight_packing_supported(torch.float32, CPU, float32=True),
                                reason="torch was built without oneDNN")


def test_float32_weights_are_packed_only_when_asked() -> None:
    assert not weight_packing_supported(torch.float32, CPU)
    assert pack_linear_weights(_model(torch.float32)) == 0
    model = _model(torch.float32)
    assert pack_linear_weights(model, float32=True) == 4 * CONFIG.num_layers + 1  # qkv, o, gate_up, down; lm_head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # kvserve's few-row kernel is bf16 only: no second copy of float32 weights, whatever is asked.
    assert all(m.few_rows_weight is None for m in model.modules() if isinstance(m, PackedLinear))
    # prepack: the worker's step 2, as it calls it under --dtype auto and under --dtype float32.
    auto, explicit = _model(torch.float32), _model(torch.float32)
    assert prepack(auto, CPU, 0, float32=True) == 0  # no bytes added: the packed weights replace the dense ones
    prepack(explicit, CPU, 0)
    assert isinstance(auto.lm_head, PackedLinear) and type(explicit.lm_head) is nn.Linear


@pytest.mark.parametrize("rows", [(1,), (7,), (64,), (2, 40), (300,)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_float32_linear_computes_f_linear(rows, bias) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=bias)
    x = torch.randn(*rows, 576)
    with torch.inference_mode():
        out = PackedLinear.from_linear(linear)(x)
        expected = F.linear(x, linear.weight, linear.bias)
    assert out.shape == (*rows, 1536) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _runner(packed: bool, compiled: bool) -> ModelRunner:
    model = _model(torch.float32)
    if packed:
        pack_linear_weights(model, float32=True)
    return ModelRunner(model, CONFIG, kv_cache_config_for(model, 32, 4, torch.float32), torch.float32,
                       TorchAttentionBackend(), CPU, eos_token_ids=(), compiled=compiled)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_packed_float32_model_samples_what_the_dense_one_samples(compiled: bool) -> None:
    dense, packed = _runner(packed=False, compiled=compiled), _runner(packed=True, compiled=compiled)
    assert run_steps(packed, PLAN, fresh_seqs()) == run_steps(dense, PLAN, fresh_seqs())
    for (k_dense, v_dense), (k_packed, v_packed) in zip(dense.kv_caches, packed.kv_caches):
        torch.testing.assert_close(k_packed, k_dense, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v_packed, v_dense, rtol=1e-4, atol=1e-4)
