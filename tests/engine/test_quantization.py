"""Weight-only quantized linear layers match their dequantized reference; quantize_model swaps
every packable nn.Linear and leaves the rest (and the tied embedding) alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.attention_metadata import build_flat_batch
from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.quantization import Int4Linear, Int8Linear, int8_linear, quantize_model
from kvserve.engine.quantization.int4_linear import quantize_int4
from kvserve.engine.quantization.int8_linear import PACKED_MAX_ROWS, quantize_int8
from kvserve.engine.quantization.quantize_model import KERNEL_ENV
from kvserve.kernels import TorchAttentionBackend
from kvserve.kernels.cpu_quant_gemm import int8_gemm, quant_gemm_available

# Both sides of Int8Linear's row-count switch on torch's ops, and a 3-D input.
ROW_SHAPES = [(1,), (PACKED_MAX_ROWS,), (PACKED_MAX_ROWS + 1,), (2, 40)]


def _linear(out_features: int, in_features: int, dtype: torch.dtype, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(std=0.05)
        if bias:
            linear.bias.normal_()
    return linear.to(dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # bf16 outputs round to ~3 significant digits; the kernels accumulate in another order.
    rtol, atol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROW_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", ["torch", "vnni"])
def test_int8_linear_matches_its_dequantized_weights(dtype, rows, bias, kernel) -> None:
    if kernel == "vnni" and not quant_gemm_available():
        pytest.skip("no AVX-512 VNNI or no C++ compiler here")
    linear = _linear(96, 64, dtype, bias)
    q, scale = quantize_int8(linear.weight)
    reference = (q.float() * scale[:, None]).to(dtype)
    x = torch.randn(*rows, 64).to(dtype)
    out = Int8Linear.from_linear(linear, kernel=kernel)(x)
    assert out.shape == (*rows, 96) and out.dtype == dtype
    expected = F.linear(x.float(), reference.float(), None if linear.bias is None else linear.bias.float())
    if kernel == "vnni":  # every row count: int8 activations, ~0.5% of the output's scale
        assert (out.float() - expected).abs().max() <= 0.02 * expected.abs().max()
    else:
        _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROW_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", ["torch", "vnni"])
def test_int4_linear_matches_its_dequantized_weights(dtype, rows, bias, kernel) -> None:
    if kernel == "vnni" and not quant_gemm_available():
        pytest.skip("no AVX-512 VNNI or no C++ compiler here")
    linear = _linear(96, 64, dtype, bias)
    q, scale, zero = quantize_int4(linear.weight)
    # Dequantize with scales and zeros rounded to the stored dtype, as the kernel sees them.
    stored = torch.float16 if kernel == "vnni" else dtype
    scale, zero = scale.to(stored).float(), (zero - 8 * scale).to(stored).float() + 8 * scale.to(stored).float()
    reference = ((q.float() - 8).reshape(96, -1, 32) * scale[..., None] + zero[..., None]).reshape(96, 64)
    x = torch.randn(*rows, 64).to(dtype)
    module = Int4Linear.from_linear(linear, kernel=kernel)
    assert module.vnni == (kernel == "vnni")
    out = module(x)
    assert out.shape == (*rows, 96) and out.dtype == dtype
    expected = F.linear(x.float(), reference, None if linear.bias is None else linear.bias.float())
    if kernel == "vnni":  # activations rounded to int8 per group of 32: ~0.5% of the output's scale
        assert (out.float() - expected).abs().max() <= 0.02 * expected.abs().max()
    else:
        _close(out, expected, dtype)


def test_int4_kernel_choice_is_checked() -> None:
    with pytest.raises(ValueError, match="int4 kernel must be one of auto, vnni, torch"):
        Int4Linear.from_linear(_linear(96, 64, torch.float32, False), kernel="amx")
    with pytest.raises(ValueError, match="VNNI kernel cannot run"):  # groups of 64: torch's op only
        Int4Linear.from_linear(_linear(96, 64, torch.float32, False), 64, kernel="vnni")
    assert not Int4Linear.from_linear(_linear(96, 64, torch.float32, False), 64).vnni


@pytest.mark.parametrize("rows", [1, PACKED_MAX_ROWS + 1])
def test_int8_linear_on_the_vnni_kernel_matches_torch_s(rows) -> None:
    if not quant_gemm_available():
        pytest.skip("no AVX-512 VNNI or no C++ compiler here")
    linear = _linear(96, 64, torch.bfloat16, True)
    vnni, plain = Int8Linear.from_linear(linear, kernel="vnni"), Int8Linear.from_linear(linear, kernel="torch")
    assert vnni.vnni and not plain.vnni and vnni.qweight is None
    x = torch.randn(rows, 64).to(torch.bfloat16)
    expected = plain(x).float()
    # int8 activations per group of 32: ~0.5% of the output's scale, at every row count.
    assert (vnni(x).float() - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.parametrize("rows", [1, PACKED_MAX_ROWS + 1, 300])
def test_a_vnni_int8_layer_runs_its_kernel_at_every_row_count(rows, monkeypatch) -> None:
    # Its weights exist only in the kernel's layout: casting them back per call for an ordinary
    # matmul (what it did past PACKED_MAX_ROWS rows) cost ~30x the kernel's time on an lm_head.
    if not quant_gemm_available():
        pytest.skip("no AVX-512 VNNI or no C++ compiler here")
    layer = Int8Linear.from_linear(_linear(96, 64, torch.bfloat16, False), kernel="vnni")
    calls = []
    monkeypatch.setattr(int8_linear, "int8_gemm", lambda x, packed: calls.append(x.shape[0]) or int8_gemm(x, packed))
    monkeypatch.setattr(int8_linear, "F", None)  # any other matmul route fails loudly
    assert layer(torch.randn(rows, 64).to(torch.bfloat16)).shape == (rows, 96)
    assert calls == [rows]


def test_quantized_layers_take_the_vnni_kernels_by_default_where_they_run(monkeypatch) -> None:
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    quantize_model(model, "int8")
    assert [layer.vnni for layer in model] == [quant_gemm_available()] * 2


def test_the_kernel_comes_from_the_environment_where_not_given(monkeypatch) -> None:
    monkeypatch.setenv(KERNEL_ENV, "torch")
    model = nn.Sequential(nn.Linear(64, 96))
    quantize_model(model, "int4")
    assert isinstance(model[0], Int4Linear) and not model[0].vnni
    monkeypatch.setenv(KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="KVSERVE_QUANT_KERNEL.*one of auto, vnni, torch, got 'fast'"):
        quantize_model(nn.Sequential(nn.Linear(64, 96)), "int4")


def test_quantization_error_is_within_half_a_step() -> None:
    weight = _linear(64, 128, torch.float32, False).weight
    q8, scale8 = quantize_int8(weight)
    assert ((q8.float() * scale8[:, None] - weight).abs() <= scale8[:, None] / 2 + 1e-7).all()
    q4, scale4, zero4 = quantize_int4(weight)
    assert q4.min() >= 0 and q4.max() <= 15
    dequant = ((q4.float() - 8).reshape(64, -1, 32) * scale4[..., None] + zero4[..., None]).reshape(64, 128)
    assert ((dequant - weight).abs().reshape(64, -1, 32) <= scale4[..., None] / 2 + 1e-6).all()


def test_int4_rejects_shapes_torch_cannot_pack() -> None:
    with pytest.raises(ValueError, match="int4 needs"):
        Int4Linear.from_linear(nn.Linear(64, 24))  # 24 output channels: not a multiple of 16


def _tiny_model(intermediate: int = 96) -> tuple[ModelConfig, LlamaForCausalLM]:
    config = ModelConfig(
        architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=intermediate, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=None,
        rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=None, eos_token_ids=(2,))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1)
    return config, model.eval()


def _logits(model: LlamaForCausalLM, config: ModelConfig, ids: list[int]) -> torch.Tensor:
    shape = (4, config.num_kv_heads, 16, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    flat = build_flat_batch([len(ids)], [0], [[[0, 1, 2, 3]]], 16)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), flat.positions, caches, flat.layer_metadata([0] * len(caches)), TorchAttentionBackend())
        return model.compute_logits(hidden)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_model_converts_every_linear_and_keeps_the_embedding(mode) -> None:
    config, model = _tiny_model()
    embedding = model.embed_tokens.weight.detach().clone()
    ids = list(range(3, 40))
    before = _logits(model, config, ids)
    summary = quantize_model(model, mode)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert len(summary.quantized) == 2 * 4 + 1 and summary.kept == ()
    assert summary.bytes_after < summary.bytes_before
    layer = model.layers[0]
    expected = Int8Linear if mode == "int8" else Int4Linear
    assert isinstance(layer.self_attn.qkv_proj, expected) and isinstance(layer.mlp.down_proj, expected)
    assert isinstance(model.lm_head, Int8Linear)  # the output layer stays at 8 bits in both modes
    assert torch.equal(model.embed_tokens.weight, embedding)
    after = _logits(model, config, ids)
    assert (after - before).abs().max() < 0.1 * before.abs().max()
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() > 0.8


def test_int4_keeps_layers_it_cannot_pack() -> None:
    config, model = _tiny_model(intermediate=40)  # down_proj reads 40 inputs: not groups of 32
    summary = quantize_model(model, "int4")
    assert summary.kept == ("layers.0.mlp.down_proj", "layers.1.mlp.down_proj")
    assert isinstance(model.layers[0].mlp.down_proj, nn.Linear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, Int4Linear)
    assert _logits(model, config, [5, 6, 7]).isfinite().all()


def test_int4_group_size_reaches_every_layer_but_the_output_layer() -> None:
    config, model = _tiny_model(intermediate=128)  # every K (64, 128) holds whole groups of 64
    ids = list(range(3, 40))
    before = _logits(model, config, ids)
    summary = quantize_model(model, "int4", int4_group_size=64)
    assert summary.kept == ()
    layers = [m for name, m in model.named_modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 2 * 4 and all(m.group_size == 64 for m in layers)
    assert isinstance(model.lm_head, Int8Linear)
    assert (_logits(model, config, ids).argmax(-1) == before.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("group_size", [16, 48])
def test_an_int4_group_size_torch_cannot_run_is_refused(group_size) -> None:
    _, model = _tiny_model()
    with pytest.raises(ValueError, match="group size must be one of 32, 64, 128, 256"):
        quantize_model(model, "int4", int4_group_size=group_size)
    with pytest.raises(ValueError, match="group size must be one of"):
        Int4Linear.from_linear(_linear(96, 64, torch.bfloat16, bias=False), group_size)


def test_an_unknown_mode_is_refused() -> None:
    _, model = _tiny_model()
    with pytest.raises(ValueError, match="int8, int4"):
        quantize_model(model, "int3")


@pytest.mark.slow
@pytest.mark.parametrize("module_class", [Int8Linear, Int4Linear])
def test_quantized_linear_compiles_without_graph_breaks(module_class) -> None:
    """perf-compile wraps the forward with torch.compile after conversion: the layers must trace."""
    layer = module_class.from_linear(_linear(96, 64, torch.bfloat16, bias=True))
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    for rows in (1, 2 * PACKED_MAX_ROWS):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        with torch.inference_mode():
            torch.testing.assert_close(compiled(x).float(), layer(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kwargs,option", [
    ({"quantization": "int3"}, "--quantization"), ({"quantization": ""}, "--quantization"),
    ({"cpu_threads": 0}, "--cpu-threads"), ({"cpu_threads": -1}, "--cpu-threads"),
])
def test_engine_config_refuses_bad_values(kwargs, option) -> None:
    from kvserve.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError) as error:
        EngineConfig(**kwargs)
    assert error.value.option == option


def test_a_row_parallel_slice_quantizes_to_the_unsharded_layers_int8_values() -> None:
    """A rank holding half of each row's inputs gets the whole row's scale from its peers'
    maxima (RowParallelLinear.reduce_max), so its int8 values are the unsharded layer's slice."""
    torch.manual_seed(0)
    weight = torch.randn(24, 64)
    q, scale = quantize_int8(weight)
    halves = weight.chunk(2, dim=1)
    for rank, half in enumerate(halves):
        peer_max = halves[1 - rank].abs().amax(dim=1)
        q_rank, scale_rank = quantize_int8(half, lambda amax: torch.maximum(amax, peer_max))
        assert torch.equal(q_rank, q.chunk(2, dim=1)[rank]) and torch.equal(scale_rank, scale)
    # Alone, a half gets its own (finer) scales: a different int8 model than the unsharded one.
    assert not torch.equal(quantize_int8(halves[0])[0], q.chunk(2, dim=1)[0])
