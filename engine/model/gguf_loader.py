"""GGUF weights -> a state dict in transformers' (HF) names, dequantized to the chosen dtype.

Two llama.cpp conventions are undone here so that one forward serves both formats:
- Tensor shapes are stored reversed; `GGUFReader` already exposes numpy order ([out, in]).
- For the "llama" architecture, llama.cpp's converter permutes the rows of Q and K so that its
  interleaved RoPE works; we invert that permutation and use rotate-half RoPE like transformers.
  (Qwen2 uses llama.cpp's NEOX RoPE, which is rotate-half already: no permutation.)
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import CorruptModelError, ModelConfigError

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        raise ModelConfigError(
            f"GGUF tensor {gguf_name!r} has no place in a dense Llama-family model "
            "(mixture-of-experts and multimodal GGUFs are not supported)"
        )
    return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute`: per head, rows (0, D/2, 1, D/2+1, ...) -> (0, 1, ..., D-1).

    llama.cpp: w.reshape(H, 2, D/2, ...).swapaxes(1, 2)  (rotate-half pairs -> adjacent pairs)
    inverse:   w.reshape(H, D/2, 2, ...).swapaxes(1, 2)
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize(tensor: gguf.ReaderTensor, path: Path) -> np.ndarray:
    try:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelConfigError(
            f"{path}: tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which the installed "
            f"gguf package cannot dequantize; upgrade it (pip install -U gguf) or use another quantization"
        ) from exc


def load_gguf_weights(reader: gguf.GGUFReader, config: ModelConfig, path: Path, dtype: torch.dtype,
                      device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Returns (state dict in HF names, rope frequency factors or None)."""
    weights: dict[str, torch.Tensor] = {}
    rope_factors = None
    permutes_rope = config.architecture in ("llama", "mistral")
    for tensor in reader.tensors:
        array = dequantize(tensor, path)
        if not np.isfinite(array).all():
            raise CorruptModelError(f"{path}: tensor {tensor.name!r} holds NaN or infinite values; the file is damaged")
        if tensor.name == ROPE_FREQS:
            rope_factors = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
            continue
        name = hf_name(tensor.name)
        if permutes_rope and name.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, config.num_heads)
        elif permutes_rope and name.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, config.num_kv_heads)
        if not array.flags.writeable:  # F32/F16 tensors are views of the read-only memory map
            array = array.copy()
        weights[name] = torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)
    return weights, rope_factors
