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
        # Tensors that are one transformers tensor each only after a cut or a join: an expert's
        # slice of a stacked tensor ([experts, out, in]: name -> (tensor, e)), and DeepSeek's
        # kv_b_proj from its per-head K and V parts.
        self._experts: dict[str, tuple[gguf.ReaderTensor, int]] = {}
        self._kv_b: dict[str, dict[str, gguf.ReaderTensor]] = {}
        for tensor in reader.tensors:
            place = family.gguf_tensor(config, tensor.name)
            if place is None:
                continue
            if place.stacked_experts:
                for expert in range(int(tensor.shape[-1])):  # GGUF lists shapes reversed
                    self._experts[place.hf_name.format(expert)] = (tensor, expert)
            elif place.kv_b_part is not None:
                self._kv_b.setdefault(place.hf_name, {})[place.kv_b_part] = tensor
            else:
                self._tensors[place.hf_name] = (tensor, place)

    def __enter__(self) -> "GGUFCheckpoint":
        return self

    def __exit__(self, *exc_info: object) -> None:
        """The reader's memory map closes with the reader."""

    def names(self) -> frozenset[str]:
        return frozenset(self._tensors) | frozenset(self._experts) | frozenset(self._kv_b)

    def _tensor(self, name: str) -> tuple[gguf.ReaderTensor, GGUFTensor]:
        if name not in self._tensors:
            raise CorruptModelError(missing(self.where, name))
        return self._tensors[name]

    def _kv_b_parts(self, name: str) -> tuple[gguf.ReaderTensor, gguf.ReaderTensor]:
        parts = self._kv_b[name]
        if set(parts) != {"k", "v"}:
            raise CorruptModelError(f"{self.where}: {name!r} needs both attn_k_b and attn_v_b, found only attn_{''.join(parts)}_b")
        return parts["k"], parts["v"]

    @staticmethod
    def _numpy_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(tensor.shape.tolist()))

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._experts:
            return self._numpy_shape(self._experts[name][0])[1:]
        if name in self._kv_b:
            k_b, v_b = (self._numpy_shape(t) for t in self._kv_b_parts(name))  # [H, L, nope], [H, v, L]
            return (k_b[0] * (k_b[2] + v_b[1]), k_b[1])
        return self._numpy_shape(self._tensor(name)[0])

    def read(self, name: str, dim: int | None, start: int, stop: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        if name in self._experts or name in self._kv_b:
            if dim is not None:
                raise CorruptModelError(f"{self.where}: {name!r} is cut from a stacked or split GGUF tensor and is read whole only")
            array, place, label = self._joined(name), GGUFTensor(name), name
        else:
            tensor, place = self._tensor(name)
            array, label = self._dequantized(tensor, dim, start, stop), tensor.name
        if not np.isfinite(array).all():
            raise CorruptModelError(f"{self._path}: tensor {label!r} holds NaN or infinite values; the file is damaged")
        if place.rope_rows_per_head is not None:
            array = unpermute_rope_rows(array, array.shape[0] // place.rope_rows_per_head)
        if place.shift:
            array = array - np.float32(place.shift)
        if not array.flags.writeable:  # F32/F16 tensors are views of the read-only memory map
            array = array.copy()
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

    def _joined(self, name: str) -> np.ndarray:
        if name in self._experts:
            tensor, expert = self._experts[name]
            return self._dequantize(tensor, tensor.data[expert]).reshape(self.shape(name))
        k_tensor, v_tensor = self._kv_b_parts(name)
        k_b = self._dequantize(k_tensor, k_tensor.data).reshape(self._numpy_shape(k_tensor))  # [H, L, nope]
        v_b = self._dequantize(v_tensor, v_tensor.data).reshape(self._numpy_shape(v_tensor))  # [H, v, L]
        return np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(self.shape(name))

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
