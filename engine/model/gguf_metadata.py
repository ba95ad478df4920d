"""Reading a GGUF file's header: metadata fields and tensor directory, no weight data.

`gguf.GGUFReader` memory-maps the file, so opening it touches only the header; a truncated or
foreign file fails here with CorruptModelError instead of deep inside numpy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from kvserve.engine.model.model_errors import CorruptModelError, ModelConfigError
from kvserve.paging.kv_sizing import ModelShape


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


class GGUFFields:
    """One GGUF file's metadata as a family's config parser reads it: `{architecture}.{key}`
    fields, general ones, the tensor directory, and small tensors that carry configuration."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self.reader, self.path = reader, path
        self.architecture = str(field_value(reader, "general.architecture"))
        self.tensor_names = frozenset(t.name for t in reader.tensors)

    def get(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}`; without a default, a missing field is a CorruptModelError."""
        value = field_value(self.reader, f"{self.architecture}.{key}")
        if value is None and default is None:
            raise CorruptModelError(f"{self.path}: GGUF metadata lacks {self.architecture}.{key}")
        return default if value is None else value

    def optional(self, key: str) -> Any:
        return field_value(self.reader, f"{self.architecture}.{key}")

    def general(self, key: str) -> Any:
        """A field by its full name ("tokenizer.ggml.eos_token_id"), None when absent."""
        return field_value(self.reader, key)

    def shape(self) -> ModelShape:
        return shape_from_gguf(self.reader, self.path)

    def small_tensor(self, name: str) -> np.ndarray | None:
        """A float32 tensor that carries configuration (llama.cpp's `rope_freqs.weight`)."""
        for tensor in self.reader.tensors:
            if tensor.name == name:
                return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        return None
