"""Small steps of a plain bf16 Llama as one C++ call (engine/model/fused_decode.py): after the
warm-up, steps whose rows fit the few-row kernel run every layer through kvserve_bf16.decoder_layers
and sample what the compiled layers sample, with the same cache contents, bit for bit; larger steps
and models or backends the op does not compute keep the compiled layers; bad op input is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.engine.attention_metadata import build_flat_batch
from kvserve.engine.compilation import symbolic_sizes
from kvserve.engine.model import fused_decode
from kvserve.engine.model.fused_decode import FusedDecodeLayers
from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.quantization.quantize_model import quantize_model
from kvserve.engine.worker.kv_cache_sizing import kv_cache_config_for
from kvserve.engine.worker.model_preparation import prepack
from kvserve.kernels import TorchAttentionBackend
from kvserve.kernels.cpu_attention import cpu_kernel_available
from kvserve.kernels.cpu_bf16_gemm import bf16_gemm_available, decoder_layers
from tests.engine.test_model_runner import Seq, run_steps

pytestmark = pytest.mark.skipif(not (bf16_gemm_available() and cpu_kernel_available()),
                                reason="needs kvserve's bf16 and attention CPU kernels (AVX-512 and a C++ compiler)")

BLOCK = 16
# The op's shape rules: hidden size and head dim multiples of 32; GQA (4 heads over 2 KV heads); gate_up
# wider than the narrow layers that keep the few-row kernel up to 1,024 rows, so that it stops at 128.
CONFIG = ModelConfig(
    architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=544, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=32, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
    max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False, bos_token_id=None,
    eos_token_ids=(2,),
)


def _model(config: ModelConfig = CONFIG, dtype: torch.dtype = torch.bfloat16,
           quantization: str | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    model = model.to(dtype).eval()
    if quantization is not None:
        quantize_model(model, quantization)
    prepack(model, torch.device("cpu"), 0)
    return model


def _runner(model: LlamaForCausalLM, attention: TorchAttentionBackend | None = None) -> ModelRunner:
    runner = ModelRunner(model, model.config, kv_cache_config_for(model, 256, BLOCK, torch.bfloat16), torch.bfloat16,
                         attention or TorchAttentionBackend(validate=False), torch.device("cpu"), eos_token_ids=(),
                         compiled=True)
    runner.warm_up()
    return runner


def _seqs() -> list[Seq]:
    """Prompts across block boundaries; 20 decoding requests make steps wider than 16 rows (the
    kernel's AMX row blocks) and one prompt is longer than the few-row kernel takes in one step."""
    seqs = [Seq("long", [(7 * i) % 90 + 3 for i in range(150)], list(range(1, 11)))]
    seqs += [Seq(f"r{i}", [(5 * i + 3 * j) % 90 + 3 for j in range(_prompt_len(i))], [11 + 2 * i, 12 + 2 * i])
             for i in range(1, 21)]
    return seqs


def _prompt_len(i: int) -> int:
    return 3 + i % 5


# (sequence, tokens) per step: the long prompt alone (past the kernel's rows), then all but the last
# token of 20 prompts at once (80 rows), then their last tokens and the rest of the long prompt, then
# decodes of everyone.
PLAN = [[(0, 140)], [(i, _prompt_len(i) - 1) for i in range(1, 21)], [(i, 1) for i in range(1, 21)] + [(0, 10)]]
PLAN += [[(i, 1) for i in range(0, 21)] for _ in range(4)] + [[(3, 1)], [(0, 1), (7, 1)]]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    rows: list[int] = []

    def counted(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows.append(x.shape[0])
        return decoder_layers(x, *args, **kwargs)

    monkeypatch.setattr(fused_decode, "decoder_layers", counted)
    return rows


def test_small_steps_run_the_op_and_match_the_compiled_layers_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    fused, compiled = _runner(_model()), _runner(_model())
    assert isinstance(fused.model.fused_layers, FusedDecodeLayers)
    compiled.model.fused_layers = None
    rows = _counting(monkeypatch)
    with torch.inference_mode():
        expected = run_steps(compiled, PLAN, _seqs())
        assert rows == []
        got = run_steps(fused, PLAN, _seqs())
    # Every step within the few-row kernel's rows went through the op: all but the long prompt's own
    # (140 rows) where oneDNN takes prompt chunks past FEW_ROWS_MAX, every step where the kernel
    # keeps them (AVX-512 BF16 without AMX: VECTOR_ROWS_MAX).
    max_rows = fused.model.fused_layers.max_rows
    step_rows = [sum(n for _, n in plan_step) for plan_step in PLAN]
    assert rows == [n for n in step_rows if n <= max_rows] and len(rows) >= len(PLAN) - 1
    assert got == expected
    for (k_fused, v_fused), (k_compiled, v_compiled) in zip(fused.kv_caches, compiled.kv_caches):
        assert torch.equal(k_fused, k_compiled) and torch.equal(v_fused, v_compiled)


# Wide enough that a rounding which differs once in ~2^16 values shows: 128 rows x 512 x 4 layers x 2 norms.
WIDE = dataclasses.replace(CONFIG, hidden_size=512, intermediate_size=1088, num_layers=4, num_heads=16,
                           num_kv_heads=4)


def test_the_op_equals_the_compiled_layers_on_random_hidden_states() -> None:
    # A residual stream far larger than a layer's update: x + attn then needs more bits than bf16
    # has, and its square more than fp32 has, so that a multiply-add fused into one rounding (g++'s
    # default in C++, not inductor's) changes some of the norms' outputs. Decodes after earlier
    # context and a prompt chunk after earlier context.
    runner = _runner(_model(WIDE))
    fused: FusedDecodeLayers = runner.model.fused_layers
    assert fused.max_rows >= 128
    runner.model.fused_layers = None
    query_lens, contexts = [1] * 119 + [9], [30] * 119 + [20]
    tables = [[[1 + 2 * i, 2 + 2 * i] for i in range(len(query_lens))]]
    flat = build_flat_batch(query_lens, contexts, tables, BLOCK, torch.device("cpu"), runner.group_windows)
    meta = runner.attention.prepare(flat.group_metadata[0])
    generator = torch.Generator().manual_seed(1)
    for cache in runner.kv_caches:
        for tensor in cache:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
    x = (torch.randn(128, WIDE.hidden_size, generator=generator) * 300).to(torch.bfloat16)
    rope = runner.model.rotary_emb(flat.positions, torch.bfloat16)
    compiled_caches = [tuple(t.clone() for t in cache) for cache in runner.kv_caches]
    with torch.inference_mode(), symbolic_sizes():
        expected = x
        for layer, cache in zip(runner.model.layers, compiled_caches):
            expected = layer(expected, rope, cache, meta, runner.attention)
        got = fused(x, rope, runner.kv_caches, meta)
    assert torch.equal(got, expected)
    for (k, v), (k_expected, v_expected) in zip(runner.kv_caches, compiled_caches):
        assert torch.equal(k, k_expected) and torch.equal(v, v_expected)


@pytest.mark.parametrize("change", ["attention_bias", "float32", "int8", "validating backend", "fp8 scales"])
def test_models_and_backends_the_op_does_not_compute_keep_the_compiled_layers(change: str) -> None:
    config = dataclasses.replace(CONFIG, attention_bias=change == "attention_bias")
    model = _model(config, torch.float32 if change == "float32" else torch.bfloat16,
                   quantization="int8" if change == "int8" else None)
    attention = TorchAttentionBackend(validate=change == "validating backend",
                                      k_scale=0.5 if change == "fp8 scales" else None)
    assert FusedDecodeLayers.build(model, attention) is None


def test_steps_the_op_does_not_fit_keep_the_compiled_layers() -> None:
    runner = _runner(_model())
    fused: FusedDecodeLayers = runner.model.fused_layers
    x = torch.zeros(3, CONFIG.hidden_size, dtype=torch.bfloat16)
    rope = runner.model.rotary_emb(torch.arange(3), torch.bfloat16)
    flat = build_flat_batch([3], [0], [[[1]]], BLOCK, torch.device("cpu"), [0])
    meta = flat.group_metadata[0]
    metas = [meta] * CONFIG.num_layers
    assert fused.fits(x, rope, runner.kv_caches, metas)
    wide = torch.zeros(fused.max_rows + 1, CONFIG.hidden_size, dtype=torch.bfloat16)
    assert not fused.fits(wide, rope, runner.kv_caches, metas)
    assert not fused.fits(x.float(), rope, runner.kv_caches, metas)
    assert not fused.fits(x, rope, runner.kv_caches, [meta, dataclasses.replace(meta), meta])
    assert not fused.fits(x, rope, runner.kv_caches, [dataclasses.replace(meta, sliding_window=8)] * 3)
    assert not fused.fits(x, (rope[0][:, :16], rope[1][:, :16]), runner.kv_caches, metas)  # partial rotary


def test_bad_op_input_is_refused_with_a_clear_error() -> None:
    runner = _runner(_model())
    fused: FusedDecodeLayers = runner.model.fused_layers
    meta = build_flat_batch([2], [0], [[[1]]], BLOCK, torch.device("cpu"), [0]).group_metadata[0]
    rope = runner.model.rotary_emb(torch.arange(2), torch.bfloat16)
    x = torch.zeros(2, CONFIG.hidden_size, dtype=torch.bfloat16)
    blocks = fused.blocks
    args = dict(input_norms=[b.input_norm for b in blocks], qkv_weights=[b.qkv.few_rows_weight for b in blocks],
                o_weights=[b.o.few_rows_weight for b in blocks], post_norms=[b.post_norm for b in blocks],
                gate_up_weights=[b.gate_up.few_rows_weight for b in blocks],
                down_weights=[b.down.few_rows_weight for b in blocks],
                key_caches=[c[0] for c in runner.kv_caches], value_caches=[c[1] for c in runner.kv_caches], meta=meta,
                num_heads=4, num_kv_heads=2, intermediate_size=544, eps=1e-6, scale=32**-0.5)
    with pytest.raises(ValueError, match="one entry per layer"):
        decoder_layers(x, *rope, **{**args, "o_weights": args["o_weights"][:2]})
    with pytest.raises(ValueError, match="x must be bf16"):
        decoder_layers(x.float(), *rope, **args)
    with pytest.raises(ValueError, match="cos and sin"):
        decoder_layers(x, rope[0][:1], rope[1], **args)
    with pytest.raises(ValueError, match="norm weights"):
        decoder_layers(x, *rope, **{**args, "post_norms": [n.float() for n in args["post_norms"]]})
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        decoder_layers(x, *rope, **{**args, "num_kv_heads": 3})
