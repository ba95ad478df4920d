"""A GGUF file's weights under their Hugging Face names, dequantized to the chosen dtype, read
tensor by tensor and, for a tensor-parallel rank, slice by slice.

Two llama.cpp conventions are undone here so that one forward serves both formats:
- Tensor shapes are stored reversed; `GGUFReader` already exposes numpy order ([out, in]).
- Where the family says so (Llama's Q and K), llama.cpp's converter permuted the rows of each
  head for its interleaved rope; we invert that per head, so a slice of whole heads unpermutes
  on its own, and the forward uses rotate-half rope as transformers does.

Quantized tensors are stored as rows of blocks along the input features: a range of rows
dequantizes only those rows; a range of columns that falls on block boundaries dequantizes only
those blocks, and any other range is dequantized a few rows at a time and cut.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from kvserve.engine.model.checkpoint import missing
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import CorruptModelError, ModelConfigError
from kvserve.engine.model.model_family import GGUFTensor, ModelFamily

ROWS_PER_CHUNK = 256  # dequantized at a time when a column range cuts quantization blocks


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute`: per head, rows (0, D/2, 1, D/2+1, ...) -> (0, 1, ..., D-1).

    llama.cpp: w.reshape(H, 2, D/2, ...).swapaxes(1, 2)  (rotate-half pairs -> adjacent pairs)
    inverse:   w.reshape(H, D/2, 2, ...).swapaxes(1, 2)
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    def __init__(self, reader: gguf.GGUFReader, path: Path, family: ModelFamily, config: ModelConfig) -> None:
        self.where = str(path)
        self._path = path
        self._tensors: dict[str, tuple[gguf.ReaderTensor, GGUFTensor]] = {}
        for tensor in reader.tensors:
            place = family.gguf_tensor(config, tensor.name)
            if place is not None:
                self._tensors[place.hf_name] = (tensor, place)

    def __enter__(self) -> "GGUFCheckpoint":
        return self

    def __exit__(self, *exc_info: object) -> None:
        """The reader's memory map closes with the reader."""

    def names(self) -> frozenset[str]:
        return frozenset(self._tensors)

    def _tensor(self, name: str) -> tuple[gguf.ReaderTensor, GGUFTensor]:
        if name not in self._tensors:
            raise CorruptModelError(missing(self.where, name))
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(name)[0].shape.tolist()))

    def read(self, name: str, dim: int | None, start: int, stop: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        tensor, place = self._tensor(name)
        array = self._dequantized(tensor, dim, start, stop)
        if not np.isfinite(array).all():
            raise CorruptModelError(f"{self._path}: tensor {tensor.name!r} holds NaN or infinite values; the file is damaged")
        if place.rope_rows_per_head is not None:
            array = unpermute_rope_rows(array, array.shape[0] // place.rope_rows_per_head)
        if not array.flags.writeable:  # F32/F16 tensors are views of the read-only memory map
            array = array.copy()
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

    def _dequantized(self, tensor: gguf.ReaderTensor, dim: int | None, start: int, stop: int) -> np.ndarray:
        data = tensor.data
        if dim is None or (data.ndim == 1 and dim == 0):
            whole = self._dequantize(tensor, data)
            return whole if dim is None else whole[start:stop]
        if dim == 0:
            return self._dequantize(tensor, data[start:stop])
        block, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                  gguf.GGMLQuantizationType.BF16):
            return self._dequantize(tensor, data[:, start:stop])
        if start % block == 0 and stop % block == 0:  # whole quantization blocks: cut the bytes
            cut = data[:, start // block * block_bytes: stop // block * block_bytes]
            return self._dequantize(tensor, np.ascontiguousarray(cut))
        out = np.empty((data.shape[0], stop - start), dtype=np.float32)
        for first in range(0, data.shape[0], ROWS_PER_CHUNK):
            rows = data[first:first + ROWS_PER_CHUNK]
            out[first:first + rows.shape[0]] = self._dequantize(tensor, rows)[:, start:stop]
        return out

    def _dequantize(self, tensor: gguf.ReaderTensor, data: np.ndarray) -> np.ndarray:
        try:
            return gguf.quants.dequantize(data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelConfigError(
                f"{self._path}: tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which the "
                f"installed gguf package cannot dequantize; upgrade it (pip install -U gguf) or use another quantization"
            ) from exc
