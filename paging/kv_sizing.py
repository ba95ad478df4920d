"""How much memory the KV cache needs, and how many blocks a memory budget buys.

    KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes

GQA/MQA shrink it by num_heads / num_kv_heads against multi-head attention: Llama-2-70B keeps 8
KV heads for 64 query heads, so its cache is 8x smaller than an MHA model of the same shape.
Shapes come from presets, a config.json (or an HF model folder) or a GGUF file's metadata.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvserve.paging.block_allocator import validate_block_size
from kvserve.paging.errors import KVCacheTooSmallError

KV_DTYPE_BYTES = {
    "fp32": 4, "float32": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "int8": 1,
}  # fmt: skip


def kv_dtype_bytes(kv_dtype: str) -> int:
    try:
        return KV_DTYPE_BYTES[kv_dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}: use one of fp32, fp16, bf16, fp8, int8") from None


@dataclass(frozen=True)
class ModelShape:
    """The attention shape that decides KV size."""

    name: str
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        counts = {"num_layers": self.num_layers, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        for field_name, count in counts.items():
            if count < 1:
                raise ValueError(f"{self.name}: {field_name} must be at least 1, got {count}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} query heads cannot be grouped over {self.num_kv_heads} KV heads")

    @property
    def gqa_factor(self) -> int:
        """Query heads per KV head: 1 for MHA, num_heads for MQA."""
        return self.num_heads // self.num_kv_heads

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def as_mha(self) -> ModelShape:
        """The same model with one KV head per query head (what GQA saves against)."""
        return replace(self, num_kv_heads=self.num_heads)

    def bytes_per_token(self, kv_dtype: str) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes(kv_dtype)

    def kv_cache_bytes(self, kv_dtype: str, num_tokens: int, batch: int = 1) -> int:
        return self.bytes_per_token(kv_dtype) * num_tokens * batch

    def bytes_per_block(self, kv_dtype: str, block_size: int = 16) -> int:
        return self.bytes_per_token(kv_dtype) * block_size


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("gpt2", num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64, max_position_embeddings=1024),
        ModelShape("llama-7b", num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096),
        ModelShape("llama-70b", num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=4096),
        ModelShape("gpt3-175b", num_layers=96, num_heads=96, num_kv_heads=96, head_dim=128, max_position_embeddings=2048),
        ModelShape("smollm2-135m", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192),
    )
}


def num_blocks_for_memory(memory_bytes: int, shape: ModelShape, kv_dtype: str, block_size: int = 16) -> int:
    """Whole blocks that fit in `memory_bytes` (K and V of every layer)."""
    validate_block_size(block_size)
    if memory_bytes < 0:
        raise ValueError(f"memory must be >= 0 bytes, got {memory_bytes}")
    return memory_bytes // shape.bytes_per_block(kv_dtype, block_size)


def max_model_len_that_fits(num_blocks: int, block_size: int = 16) -> int:
    """The longest single request the cache can hold: every block for one request."""
    return num_blocks * block_size


def check_max_model_len_fits(max_model_len: int, num_blocks: int, block_size: int = 16) -> None:
    """Start-up check: raises KVCacheTooSmallError (naming the largest max_model_len that fits)
    when one request of max_model_len tokens cannot get its blocks."""
    largest = max_model_len_that_fits(num_blocks, block_size)
    if max_model_len > largest:
        raise KVCacheTooSmallError(max_model_len, largest, num_blocks, block_size)


def plan_num_kv_blocks(
    shape: ModelShape,
    kv_dtype: str,
    block_size: int,
    max_model_len: int,
    *,
    num_kv_blocks: int | None = None,
    kv_cache_memory: int | None = None,
) -> int:
    """The engine's start-up sizing: an explicit block count wins, else the memory budget
    (--kv-cache-memory, or the engine's default share of what the weights left). Fails with
    KVCacheTooSmallError when one max_model_len request would not fit."""
    if num_kv_blocks is None and kv_cache_memory is None:
        raise ValueError("give the KV cache a size: num_kv_blocks (--num-kv-blocks) or kv_cache_memory (--kv-cache-memory)")
    if num_kv_blocks is not None:
        validate_block_size(block_size)
        num_blocks = num_kv_blocks
    else:
        num_blocks = num_blocks_for_memory(kv_cache_memory, shape, kv_dtype, block_size)
    check_max_model_len_fits(max_model_len, num_blocks, block_size)
    return num_blocks


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-z]*)\s*$")


def parse_memory_size(text: str) -> int:
    """'80GB' (10^9), '74.5GiB' (2^30), '24e9' or '1048576' (bytes) -> bytes."""
    match = _SIZE.match(text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}: write a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GB")
    size = round(float(match.group(1)) * _UNITS[match.group(2)])
    if size < 1:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return size


def resolve_model_shape(model: str) -> ModelShape:
    """A preset name (case-insensitive) or a path to a config.json, an HF model folder or a .gguf file."""
    preset = PRESETS.get(model.lower())
    if preset is not None:
        return preset
    path = Path(model)
    if path.exists():
        return read_model_shape(path)
    raise ValueError(f"unknown model {model!r}: give a preset ({', '.join(PRESETS)}) or a path to a config.json, an HF model folder or a .gguf file")


def read_model_shape(path: Path) -> ModelShape:
    if path.is_dir():
        if (path / "config.json").is_file():
            path = path / "config.json"
        else:
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(f"{path} has no config.json and {len(ggufs)} .gguf files: pass the file itself")
            path = ggufs[0]
    if path.suffix == ".gguf":
        return _shape_from_gguf(path)
    return _shape_from_config(path.parent.name if path.name == "config.json" else path.stem, json.loads(path.read_text()))


def _shape_from_config(name: str, config: dict[str, Any]) -> ModelShape:
    """HF config.json: Llama-style names, or GPT-2's n_layer / n_head / n_embd."""
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    hidden = config.get("hidden_size", config.get("n_embd"))
    if layers is None or heads is None or hidden is None:
        raise ValueError(f"config {name!r} lacks the layer count, head count or hidden size (num_hidden_layers, num_attention_heads, hidden_size)")
    return ModelShape(
        name=name,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        max_position_embeddings=config.get("max_position_embeddings", config.get("n_positions")),
    )


def _shape_from_gguf(path: Path) -> ModelShape:
    import gguf  # numpy only, no torch; imported here so kvserve.paging stays light

    reader = gguf.GGUFReader(path)

    def value(key: str) -> Any:
        field = reader.fields.get(key)
        if field is None:
            return None
        if field.types[0] == gguf.GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        # Some models list a per-layer KV head count; the largest layer decides the block size.
        return max(int(field.parts[index][0]) for index in field.data)

    arch = value("general.architecture")
    layers, heads, hidden = value(f"{arch}.block_count"), value(f"{arch}.attention.head_count"), value(f"{arch}.embedding_length")
    if arch is None or layers is None or heads is None or hidden is None:
        raise ValueError(f"{path} lacks the GGUF metadata that gives the attention shape ({arch}.block_count, .attention.head_count, .embedding_length)")
    return ModelShape(
        name=path.stem,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=value(f"{arch}.attention.head_count_kv") or heads,
        head_dim=value(f"{arch}.attention.key_length") or hidden // heads,
        max_position_embeddings=value(f"{arch}.context_length"),
    )
