"""The compiled forward keeps guards only on per-call inputs; each model's layers get their own
compiled function, so a second model of the same shapes never runs the first one's graph; after
the warm-up, layers run their compiled graphs directly, without dynamo's entry."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.engine.compilation import symbolic_sizes
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.quantization.int8_linear import PACKED_MAX_ROWS
from kvserve.engine.quantization.quantize_model import KERNEL_ENV
from tests.engine.test_model_runner import CONFIG, Seq, prepare, step, tiny_runner


def _runner(rms_norm_eps: float, compiled: bool) -> ModelRunner:
    return tiny_runner(compiled, dataclasses.replace(CONFIG, rms_norm_eps=rms_norm_eps))


def _hidden(runner: ModelRunner, tokens: tuple[int, ...] = (5, 9, 14)) -> torch.Tensor:
    with torch.inference_mode():  # as the runner's execute: inputs built and run in inference mode
        blocks = list(range(-(-len(tokens) // runner.block_size)))
        runner.input_batch.requests.clear()  # each call is a fresh request "a"
        inputs = prepare(runner, step(Seq("a", list(tokens), blocks).schedule(len(tokens))))
        return runner._forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)


@pytest.mark.slow
def test_models_differing_only_in_a_layer_constant_each_run_their_own_graph() -> None:
    # Guards on module attributes (here RMSNorm's eps, a constant of the graph) are dropped: only
    # the per-model compiled function keeps the second model from reusing the first one's graph.
    first, second = _runner(1e-6, compiled=True), _runner(0.5, compiled=True)
    for runner in (first, second):
        runner.warm_up()
    first_hidden, second_hidden = _hidden(first), _hidden(second)
    torch.testing.assert_close(first_hidden, _hidden(_runner(1e-6, compiled=False)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second_hidden, _hidden(_runner(0.5, compiled=False)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first_hidden, second_hidden, atol=1e-3)


@pytest.mark.slow
def test_an_input_of_another_dtype_gets_its_own_graph() -> None:
    # The guards kept are those on the per-call inputs: a bfloat16 hidden state must not run the
    # float32 graph (it would read its bytes as float32).
    runner = _runner(1e-6, compiled=True)
    runner.warm_up()
    inputs = prepare(runner, step(Seq("a", [5, 9, 14], [0, 1]).schedule(3)))
    layer = runner.model.layers[0]
    x = torch.randn(3, CONFIG.hidden_size).to(torch.bfloat16)
    rope = runner.model.rotary_emb(inputs.positions, torch.float32)
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode(), symbolic_sizes():
        compiled = layer(x, rope, runner.kv_caches[0], inputs.attn_metadata[0], runner.attention)
        eager = layer.forward(x, rope, runner.kv_caches[0], inputs.attn_metadata[0], runner.attention)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    # Inductor rounds to bfloat16 once where eager rounds after every op: bfloat16-sized differences.
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_after_warm_up_layers_run_their_compiled_graphs_without_entering_dynamo() -> None:
    runner, eager = _runner(1e-6, compiled=True), _runner(1e-6, compiled=False)
    runner.warm_up()
    assert runner.graphs_bound
    # Sizes not seen yet: the guards pick their graphs once.
    _hidden(runner)
    _hidden(runner, (5,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        several, one = _hidden(runner), _hidden(runner, (5,))
    names = [event.name for event in profile.events()]
    assert not [n for n in names if n.startswith(("TorchDynamo Cache Lookup", "Torch-Compiled Region"))], \
        "a layer call went through torch.compile's entry"
    assert sum("CompiledFxGraph" in n for n in names) == 2 * CONFIG.num_layers, "every layer runs its compiled graph"
    torch.testing.assert_close(several, _hidden(eager), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, _hidden(eager, (5,)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_direct_layer_calls_read_their_inputs_without_dynamos_disabling_wrappers() -> None:
    # The graph's pre-graph code reads sizes through torch._dynamo.utils; called directly, outside
    # dynamo, it gets the same helpers unwrapped from torch._disable_dynamo, and computes the same.
    runner, eager = _runner(1e-6, compiled=True), _runner(1e-6, compiled=False)
    runner.warm_up()
    _hidden(runner)
    calls = runner.model.layers[0]._compiled_call_impl.func
    assert calls.functions, "no graph was bound"
    for function in calls.functions.values():
        helper_names = [n for n in function.__code__.co_names if n.startswith("__import_torch_dot__dynamo_dot_utils")]
        assert helper_names, "the pre-graph code no longer reads sizes through dynamo's utils"
        for name in helper_names:
            helpers = function.__globals__[name]
            assert helpers.call_size is torch._dynamo.utils.call_size.__wrapped__
            assert helpers.record_pregraph_bytecode_enter is torch._dynamo.utils.record_pregraph_bytecode_enter.__wrapped__
            assert helpers.is_compile_supported is torch._dynamo.utils.is_compile_supported  # the rest: dynamo's own
    torch.testing.assert_close(_hidden(runner), _hidden(eager), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_hidden(runner, (5,)), _hidden(eager, (5,)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_layer_that_branches_on_the_row_count_runs_the_graph_of_its_branch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # int8 layers on torch's ops call the packed int8 op up to PACKED_MAX_ROWS rows and cast +
    # matmul above: the warm-up's graphs (1 and 3 rows) must not serve a 20-row step.
    monkeypatch.setenv(KERNEL_ENV, "torch")
    runner = tiny_runner(compiled=True, quantization="int8")
    runner.warm_up()
    assert runner.graphs_bound
    for rows, packed_op_runs in ((3, True), (PACKED_MAX_ROWS + 4, False), (3, True)):
        tokens = tuple(range(5, 5 + rows))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            _hidden(runner, tokens)
        assert any(e.name == "aten::_weight_int8pack_mm" for e in profile.events()) == packed_op_runs, rows
