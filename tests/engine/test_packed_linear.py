"""Prepacked bf16 linear layers compute exactly what F.linear computes on oneDNN's path, and to
bf16's last bit on kvserve's few-row kernel, eagerly and compiled; pack_linear_weights packs every
bf16 nn.Linear and leaves float32 models alone. Where the CPU has bf16 arithmetic the kernel's copy
sits beside oneDNN's (counted against memory, dropped where memory is short); where oneDNN would
emulate bf16 the kernel's copy alone serves every row count, adding no memory. Both CPU kinds are
stood for by the `native_bf16` fixture, whatever this CPU is."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.model import packed_linear as packed_linear_module
from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.packed_linear import (FEW_ROWS_MAX, NARROW_IN_FEATURES, NARROW_OUT_FEATURES,
                                                NARROW_ROWS_MAX, VECTOR_ROWS_MAX, PackedLinear,
                                                few_rows_limit, few_rows_weight_bytes, pack_linear_weights,
                                                packable_weight_bytes, packed_linear, weight_packing_supported)
from kvserve.kernels.cpu_bf16_gemm import (bf16_gemm_available, bf16_linear, bf16_matrix_tiles,
                                           native_bf16_arithmetic, silu_mul)
from kvserve.engine.kv_memory import CPU_RUNTIME_OVERHEAD_BYTES
from kvserve.engine.worker.model_preparation import prepack
from tests.engine.test_kv_memory import host
from kvserve.engine.worker.kv_cache_sizing import kv_cache_config_for
from kvserve.engine.model_runner import ModelRunner
from kvserve.kernels import TorchAttentionBackend
from tests.engine.test_model_runner import CONFIG, PLAN, fresh_seqs, run_steps

pytestmark = pytest.mark.skipif(not weight_packing_supported(torch.bfloat16, torch.device("cpu")),
                                reason="oneDNN has no bf16 kernels on this CPU")
needs_kernel = pytest.mark.skipif(not bf16_gemm_available(), reason="no AVX-512 or no C++ compiler here")


@pytest.fixture(params=[True, False], ids=["native-bf16", "emulated-bf16"])
def native_bf16(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the CPU multiplies bf16 in hardware, as packing sees it."""
    monkeypatch.setattr(packed_linear_module, "native_bf16_arithmetic", lambda: request.param)
    return request.param


def _linear(bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(std=0.05)
        if bias:
            linear.bias.normal_()
    return linear.to(torch.bfloat16)


@pytest.mark.parametrize("rows", [(1,), (7,), (64,), (2, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_bit_for_bit_on_onednn(rows, bias) -> None:
    linear = _linear(bias)
    x = torch.randn(*rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        out = PackedLinear.from_linear(linear, few_rows_kernel=False)(x)
        expected = F.linear(x, linear.weight, linear.bias)
    assert out.shape == (*rows, 96) and out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


@needs_kernel
@pytest.mark.parametrize("rows", [(1,), (8,), (2, 3), (64,), (2, 40), (FEW_ROWS_MAX,), (FEW_ROWS_MAX + 1,), (300,)])
def test_the_few_row_kernel_agrees_with_onednn_to_bf16s_last_bit(rows, native_bf16: bool) -> None:
    linear = _linear(bias=True)
    x = torch.randn(*rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        layer = PackedLinear.from_linear(linear, few_rows_kernel=True)
        out = layer(x)
        expected = PackedLinear.from_linear(linear, few_rows_kernel=False)(x)
    assert layer.few_rows_weight is not None and out.shape == (*rows, 96) and out.dtype == torch.bfloat16
    # Without bf16 arithmetic the kernel's copy is the only one, for every row count.
    assert (layer.packed_weight is not None) is native_bf16
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=2**-7)
    if x.numel() > layer.few_rows_max * 64 and native_bf16:
        assert torch.equal(out, expected)  # oneDNN's path itself


@needs_kernel
@pytest.mark.parametrize("rows", [(1,), (5,), (2, 3), (64,), (300,), (VECTOR_ROWS_MAX + 1,)])
def test_silu_mul_of_a_gate_up_layer_is_silu_mul_of_its_output_where_the_kernel_serves(rows, native_bf16: bool) -> None:
    """A gate_up layer (96 = [48 gate | 48 up] channels) returns silu(gate) * up in one kernel call,
    the bits of silu_mul(layer(x)), where its kernel serves the rows; None where oneDNN does."""
    layer = PackedLinear.from_linear(_linear(bias=False), few_rows_kernel=True)
    x = torch.randn(*rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        out = layer.silu_mul(x)
        if layer.packed_weight is not None and x.numel() > layer.few_rows_max * 64:
            assert out is None
            return
        assert out is not None and torch.equal(out, silu_mul(layer(x)))
        assert layer.silu_mul(x.float()) is None  # only bf16 rows


@needs_kernel
def test_silu_mul_of_a_layer_it_cannot_pair_is_none() -> None:
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert PackedLinear.from_linear(_linear(bias=True), few_rows_kernel=True).silu_mul(x) is None  # a bias
        odd = nn.Linear(64, 80, bias=False).to(torch.bfloat16)  # halves of 40: not whole tiles of 16
        assert PackedLinear.from_linear(odd, few_rows_kernel=True).silu_mul(x) is None
        assert PackedLinear.from_linear(_linear(bias=False), few_rows_kernel=False).silu_mul(x) is None  # oneDNN alone


def test_layers_keep_the_kernel_to_more_rows_when_narrow_with_tiles_or_on_the_vector_route() -> None:
    assert few_rows_limit(576, 576, matrix_tiles=True) == NARROW_ROWS_MAX
    assert few_rows_limit(1536, NARROW_OUT_FEATURES, matrix_tiles=True) == NARROW_ROWS_MAX
    assert few_rows_limit(576, NARROW_OUT_FEATURES + 1, matrix_tiles=True) == FEW_ROWS_MAX  # gate_up: oneDNN's
    # Without tiles, the vector route: every layer up to NARROW_IN_FEATURES inputs, to more rows still.
    assert few_rows_limit(576, 576, matrix_tiles=False) == VECTOR_ROWS_MAX
    assert few_rows_limit(576, 49152, matrix_tiles=False) == VECTOR_ROWS_MAX
    assert few_rows_limit(NARROW_IN_FEATURES, 576, matrix_tiles=False) == VECTOR_ROWS_MAX
    assert few_rows_limit(NARROW_IN_FEATURES + 64, 576, matrix_tiles=False) == FEW_ROWS_MAX
    assert few_rows_limit(80, 576, matrix_tiles=True) == FEW_ROWS_MAX  # inputs the tile route cannot take
    assert few_rows_limit(NARROW_IN_FEATURES, 576, matrix_tiles=True) == NARROW_ROWS_MAX
    assert few_rows_limit(2 * NARROW_IN_FEATURES, 576, matrix_tiles=True) == FEW_ROWS_MAX  # rows past L2


@needs_kernel
@pytest.mark.parametrize("out_features", [96, NARROW_OUT_FEATURES + 16])
def test_prompt_chunks_take_the_kernel_through_narrow_layers_with_tiles_and_every_layer_without(
        out_features: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, out_features, bias=True)
    calls: list[str] = []
    for name, op in (("bf16_linear", bf16_linear), ("packed_linear", packed_linear)):
        monkeypatch.setattr(packed_linear_module, name, lambda *args, _name=name, _op=op: calls.append(_name) or _op(*args))
    row_counts = (FEW_ROWS_MAX, 300, NARROW_ROWS_MAX, NARROW_ROWS_MAX + 1, VECTOR_ROWS_MAX, VECTOR_ROWS_MAX + 1)
    with torch.inference_mode():
        linear.weight.normal_(std=0.05)
        layer = PackedLinear.from_linear(linear.to(torch.bfloat16), few_rows_kernel=True)
        if layer.packed_weight is None:
            pytest.skip("oneDNN emulates bf16 here: the kernel serves every row count")
        for rows in row_counts:
            x = torch.randn(rows, 64).to(torch.bfloat16)
            torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias), rtol=2**-7, atol=2**-7)
    kernel, onednn = "bf16_linear", "packed_linear"
    if not bf16_matrix_tiles():  # AVX-512 BF16's vector passes: every layer, up to VECTOR_ROWS_MAX rows
        assert calls == [kernel] * 5 + [onednn]
    elif out_features <= NARROW_OUT_FEATURES:  # AMX: narrow layers up to NARROW_ROWS_MAX rows
        assert calls == [kernel] * 3 + [onednn] * 3
    else:
        assert calls == [kernel] + [onednn] * 5


def test_packed_linear_compiles_as_one_op_for_any_row_count() -> None:
    packed = PackedLinear.from_linear(_linear(bias=True))
    compiled = torch.compile(lambda x: F.silu(packed(x * 2)), dynamic=True)
    with torch.inference_mode():
        for rows in (1, 5, 33):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            assert torch.equal(compiled(x), F.silu(packed(x * 2)))


def _model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    for parameter in model.parameters():
        nn.init.normal_(parameter, std=0.3)
    return model.to(dtype).eval()


def test_pack_linear_weights_packs_every_bf16_linear_and_no_float32_one() -> None:
    assert pack_linear_weights(_model(torch.float32)) == 0
    model = _model(torch.bfloat16)
    assert pack_linear_weights(model) == 4 * CONFIG.num_layers + 1  # qkv, o, gate_up, down; lm_head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)


def test_the_few_row_copies_are_counted_for_the_memory_budget(native_bf16: bool) -> None:
    model = _model(torch.bfloat16)
    pack_linear_weights(model, few_rows_kernel=False)
    assert few_rows_weight_bytes(model) == 0
    assert all(m.packed_weight is not None for m in model.modules() if isinstance(m, PackedLinear))
    model = _model(torch.bfloat16)
    dense = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear))
    assert packable_weight_bytes(model) == (dense if native_bf16 else 0)
    pack_linear_weights(model, few_rows_kernel=True)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(m.few_rows_weight is not None for m in layers)
    if native_bf16:
        assert few_rows_weight_bytes(model) >= dense  # the same weights, zero-padded to whole tiles
    else:  # the kernel's copy replaces oneDNN's: nothing beside the weights
        assert few_rows_weight_bytes(model) == 0 and all(m.packed_weight is None for m in layers)


@needs_kernel
def test_prepack_keeps_the_few_row_copy_only_where_memory_is_plentiful(tmp_path, caplog, monkeypatch) -> None:
    monkeypatch.setattr(packed_linear_module, "native_bf16_arithmetic", lambda: True)
    dense = packable_weight_bytes(_model(torch.bfloat16))
    # The copy within a quarter of what is left after the weights: made, and counted (meminfo is in kB).
    (tmp_path / "roomy").mkdir()
    model = _model(torch.bfloat16)
    added = prepack(model, torch.device("cpu"), dense, host(tmp_path / "roomy", available=8 * dense))
    assert added == few_rows_weight_bytes(model) >= dense
    # A model whose copy would take more (a 7B's is 14 GB): oneDNN only, nothing added, said once.
    (tmp_path / "tight").mkdir()
    model = _model(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="kvserve.engine.worker.model_preparation"):
        added = prepack(model, torch.device("cpu"), dense, host(tmp_path / "tight", available=3 * dense))
    assert added == 0 and few_rows_weight_bytes(model) == 0
    assert all(m.few_rows_weight is None for m in model.modules() if isinstance(m, PackedLinear))
    assert "few-row bf16 kernel off" in caplog.text
    # Under a cgroup limit the headroom is the limit less the weights and the runtime overhead.
    (tmp_path / "cgroup").mkdir()
    limit = dense + CPU_RUNTIME_OVERHEAD_BYTES + 3 * dense
    model = _model(torch.bfloat16)
    added = prepack(model, torch.device("cpu"), dense,
                    host(tmp_path / "cgroup", available=1 << 40, files={"memory.max": f"{limit}\n"}))
    assert added == 0


@needs_kernel
def test_without_bf16_arithmetic_prepack_gives_every_layer_the_kernel_alone_whatever_the_memory(
        tmp_path, caplog, monkeypatch) -> None:
    monkeypatch.setattr(packed_linear_module, "native_bf16_arithmetic", lambda: False)
    model = _model(torch.bfloat16)
    dense = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear))
    with caplog.at_level(logging.INFO, logger="kvserve.engine.worker.model_preparation"):
        added = prepack(model, torch.device("cpu"), dense, host(tmp_path, available=dense))  # no headroom
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert added == 0 and len(layers) == 4 * CONFIG.num_layers + 1
    assert all(m.packed_weight is None and m.few_rows_weight is not None for m in layers)
    assert "few-row bf16 kernel off" not in caplog.text
    assert f"{len(layers)} linear layers' weights packed for kvserve's bf16 kernel alone" in caplog.text
    assert "prepacked for oneDNN" not in caplog.text


def _runner(packed: bool, compiled: bool, few_rows_kernel: bool | None = None) -> ModelRunner:
    model = _model(torch.bfloat16)
    if packed:
        pack_linear_weights(model, few_rows_kernel)
    return ModelRunner(model, CONFIG, kv_cache_config_for(model, 32, 4, torch.bfloat16), torch.bfloat16,
                       TorchAttentionBackend(), torch.device("cpu"), eos_token_ids=(), compiled=compiled)


def test_a_packed_model_samples_what_the_dense_one_samples(native_bf16: bool) -> None:
    dense, packed = _runner(packed=False, compiled=False), _runner(packed=True, compiled=False, few_rows_kernel=False)
    dense_tokens = run_steps(dense, PLAN, fresh_seqs())
    assert run_steps(packed, PLAN, fresh_seqs()) == dense_tokens
    for (k_dense, v_dense), (k_packed, v_packed) in zip(dense.kv_caches, packed.kv_caches):
        assert torch.equal(k_packed, k_dense) and torch.equal(v_packed, v_dense)
    # kvserve's few-row kernel sums in another order: the same tokens, caches to bf16's last bit.
    if bf16_gemm_available():
        few_rows = _runner(packed=True, compiled=False, few_rows_kernel=True)
        assert run_steps(few_rows, PLAN, fresh_seqs()) == dense_tokens
        for (k_dense, v_dense), (k_few, v_few) in zip(dense.kv_caches, few_rows.kv_caches):
            torch.testing.assert_close(k_few, k_dense, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(v_few, v_dense, rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_a_compiled_packed_model_samples_what_the_compiled_dense_one_samples_without_new_graphs() -> None:
    dense, packed = _runner(packed=False, compiled=True), _runner(packed=True, compiled=True)
    dense.warm_up()
    packed.warm_up()
    torch._dynamo.utils.counters.clear()
    assert run_steps(packed, PLAN, fresh_seqs()) == run_steps(dense, PLAN, fresh_seqs())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0, "a step compiled a new graph after warm-up"
    # Compiled, the dense path may fold a residual add into its matmul (addmm) and round once
    # where the packed op rounds twice: the caches agree to bf16's last bit, not bit for bit.
    for (k_dense, v_dense), (k_packed, v_packed) in zip(dense.kv_caches, packed.kv_caches):
        torch.testing.assert_close(k_packed, k_dense, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(v_packed, v_dense, rtol=1e-2, atol=1e-2)


@pytest.mark.slow
@needs_kernel
def test_the_warm_up_compiles_the_graph_of_steps_past_the_kernels_row_limit_when_the_budget_allows() -> None:
    # The layers branch at a higher limit too (NARROW_ROWS_MAX for narrow layers with tiles,
    # VECTOR_ROWS_MAX without): a token budget past it gets that graph at start, not from the first
    # long prompt step while serving.
    if not native_bf16_arithmetic():
        pytest.skip("oneDNN emulates bf16 here: the kernel serves every row count, no branch")
    limit = NARROW_ROWS_MAX if bf16_matrix_tiles() else VECTOR_ROWS_MAX
    past_limit = [1] * 8 + [100] * (limit // 100 + 1)
    for budget, compiles_while_serving in ((limit + 64, False), (None, True)):
        runner = _runner(packed=True, compiled=True)
        runner.warm_up(budget)
        torch._dynamo.utils.counters.clear()
        with torch.inference_mode():
            runner._warm_up_forward(past_limit)
        assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0) is compiles_while_serving, budget
