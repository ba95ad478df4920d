"""Reading a GGUF file's header: metadata fields and tensor directory, no weight data.

`gguf.GGUFReader` memory-maps the file, so opening it touches only the header; a truncated or
foreign file fails here with CorruptModelError instead of deep inside numpy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import CorruptModelError, ModelConfigError, UnsupportedArchitectureError
from kvserve.paging.kv_sizing import ModelShape

# GGUF `general.architecture` -> ours. llama.cpp writes Mistral checkpoints as "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def read_gguf(path: Path) -> gguf.GGUFReader:
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # numpy/struct errors from a damaged header mean the same thing
        raise CorruptModelError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it may be truncated or "
            "not a GGUF at all: download it again"
        ) from exc
    _check_tensor_extents(reader, path)
    return reader


def _check_tensor_extents(reader: gguf.GGUFReader, path: Path) -> None:
    """A truncated file parses (the memmap just ends early), so compare each tensor's byte range
    with the file size ourselves."""
    file_size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > file_size or tensor.data.nbytes != tensor.n_bytes:
            raise CorruptModelError(
                f"{path} is truncated: tensor {tensor.name!r} needs bytes up to "
                f"{tensor.data_offset + tensor.n_bytes:,} but the file has {file_size:,}; download it again"
            )


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    """A metadata value as a Python scalar, str or list; None when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    def decode(part: np.ndarray, vtype: gguf.GGUFValueType) -> Any:
        return bytes(part).decode("utf-8") if vtype == gguf.GGUFValueType.STRING else part.tolist()[0]
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [decode(field.parts[i], field.types[-1]) for i in field.data]
    return decode(field.parts[field.data[0]], field.types[0])


def shape_from_gguf(reader: gguf.GGUFReader, path: Path) -> ModelShape:
    """The KV-deciding fields of any architecture's GGUF metadata (`kvserve kv-size` plans for
    models the engine does not run, so the architecture is not checked here)."""
    arch = field_value(reader, "general.architecture")

    def count(key: str, default: int | None = None) -> int:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            if default is None:
                raise CorruptModelError(f"{path}: GGUF metadata lacks {arch}.{key}, which gives the attention shape")
            return default
        # Some models list a per-layer KV head count; the largest layer decides the block size.
        return max(value) if isinstance(value, list) else int(value)

    num_heads, hidden = count("attention.head_count"), count("embedding_length")
    try:
        return ModelShape(
            name=path.stem,
            num_layers=count("block_count"),
            num_heads=num_heads,
            num_kv_heads=count("attention.head_count_kv", num_heads),
            head_dim=count("attention.key_length", hidden // num_heads),
            max_position_embeddings=field_value(reader, f"{arch}.context_length"),
        )
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from exc


def model_config_from_gguf(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    gguf_arch = field_value(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(str(gguf_arch), str(path))

    def get(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{gguf_arch}.{key}")
        if value is None and default is None:
            raise CorruptModelError(f"{path}: GGUF metadata lacks {gguf_arch}.{key}")
        return default if value is None else value

    shape = shape_from_gguf(reader, path)
    tensor_names = {t.name for t in reader.tensors}
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab_size = int(get("vocab_size", len(tokens) if tokens else None))
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    scaling_type = field_value(reader, f"{gguf_arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type in ("linear", "dynamic"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelConfigError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported")
    # Llama 3.1 GGUFs carry their llama3 rope scaling as a `rope_freqs.weight` tensor instead of
    # metadata; the loader applies it to the rotary inverse frequencies directly.
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[gguf_arch],
        vocab_size=vocab_size,
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(t for t in (eos, eot) if t is not None)),
    )
