"""`kvserve kv-size`: plan KV-cache memory before buying or booking a GPU.

    kvserve kv-size --model llama-70b --tokens 4096 32768 --kv-dtype fp16 --memory 80GB

Sizes are printed in GB (10^9 bytes, as papers and spec sheets print them) and GiB (2^30, as
nvidia-smi and torch print them). A model with sliding-window layers (Mistral 7B v0.1, Gemma 2/3)
gets its global and window layers apart: a window layer keeps its last w tokens whatever the
context, so at long contexts the global layers are most of the cache.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvserve.engine import (
    MODEL_SHAPE_PRESETS, SUPPORTED_BLOCK_SIZES, ModelShape, blocks_per_decoding_request, num_blocks_for_memory,
    parse_memory_size, resolve_model_shape,
)

# --kv-dtype name -> bytes per element, and the cache dtype as the engine names it (int8's rows
# carry a float32 scale each: 4 bytes per token, KV head and K or V, counted by the layer specs).
KV_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
KV_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn", "int8": "int8"}
GB, GIB = 10**9, 2**30


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kv-size",
        help="print the KV cache size of a model at given context lengths",
        description="KV bytes per token = 2 * layers * kv_heads * head_dim * dtype bytes (latent attention: layers * "
        "(kv_lora_rank + qk_rope_head_dim) * dtype bytes; int8 adds a 4-byte scale per token, KV head and K or V). Prints the cache size per context length and batch, the "
        "GQA/MQA/MLA saving against MHA, and with --memory how many blocks and requests fit.",
    )
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(MODEL_SHAPE_PRESETS)}) "
                        "or a path to a config.json, an HF model folder or a .gguf file")  # fmt: skip
    parser.add_argument("--tokens", type=_positive_int, nargs="+", required=True, metavar="N", help="context lengths (tokens per request)")
    parser.add_argument("--kv-dtype", choices=tuple(KV_DTYPE_BYTES), default="fp16", help="KV cache element type (default: fp16)")
    parser.add_argument("--batch", type=_positive_int, default=1, help="concurrent requests (default: 1)")
    parser.add_argument("--memory", type=_memory_size, metavar="SIZE", help="KV memory budget, e.g. 80GB, 74.5GiB or bytes")
    parser.add_argument("--block-size", type=int, choices=SUPPORTED_BLOCK_SIZES, default=16, help="tokens per KV block (default: 16)")


def run(args: argparse.Namespace) -> int:
    try:
        shape = resolve_model_shape(args.model)
    except (ValueError, OSError) as error:
        print(f"kvserve kv-size: {error}", file=sys.stderr)
        return 2
    if args.kv_dtype == "int8" and shape.attention_kind == "MLA":
        print("kvserve kv-size: an int8 KV cache is not supported for latent attention (MLA) models; use fp8 or fp16",
              file=sys.stderr)
        return 2
    print(kv_size_report(shape, args.tokens, args.kv_dtype, args.batch, args.memory, args.block_size))
    return 0


def kv_size_report(
    shape: ModelShape,
    tokens: Sequence[int],
    kv_dtype: str,
    batch: int = 1,
    memory_bytes: int | None = None,
    block_size: int = 16,
) -> str:
    dtype_bytes, dtype = KV_DTYPE_BYTES[kv_dtype], KV_DTYPE_NAMES[kv_dtype]
    per_token = shape.bytes_per_token(dtype_bytes, dtype=dtype)
    mha = shape.as_mha()
    saves = shape.attention_kind != "MHA"
    lines = [
        _shape_line(shape),
        _attention_line(shape),
        f"KV per token ({kv_dtype}): {per_token:,} bytes = {per_token / 2**10:,.1f} KiB"
        + (f"   (as MHA: {mha.bytes_per_token(dtype_bytes, dtype=dtype):,} bytes = {mha.bytes_per_token(dtype_bytes, dtype=dtype) / 2**10:,.1f} KiB)" if saves else ""),
        "",
    ]
    if shape.num_window_layers:
        lines[-1:-1] = [_layers_line(shape)]
        lines += _window_table(shape, tokens, dtype_bytes, dtype, batch)
        if memory_bytes is not None:
            lines += ["", *_memory_lines(shape, tokens, kv_dtype, memory_bytes, block_size)]
        return "\n".join(lines)
    header = f"{'tokens':>10} {'batch':>6} {'KV (GB)':>12} {'KV (GiB)':>12}"
    lines.append(header + (f" {'as MHA (GB)':>12}" if saves else ""))
    for num_tokens in tokens:
        size = shape.kv_cache_bytes(dtype_bytes, num_tokens, batch, dtype=dtype)
        row = f"{num_tokens:>10,} {batch:>6} {size / GB:>12,.2f} {size / GIB:>12,.2f}"
        if saves:
            row += f" {mha.kv_cache_bytes(dtype_bytes, num_tokens, batch, dtype=dtype) / GB:>12,.2f}"
        lines.append(row)
    if memory_bytes is not None:
        lines += ["", *_memory_lines(shape, tokens, kv_dtype, memory_bytes, block_size)]
    return "\n".join(lines)


def _layers_line(shape: ModelShape) -> str:
    return (f"layers: {shape.num_global_layers} global (every token) + {shape.num_window_layers} sliding-window "
            f"(the last {shape.sliding_window:,} tokens each)")


def _window_table(shape: ModelShape, tokens: Sequence[int], dtype_bytes: int, dtype: str, batch: int) -> list[str]:
    """Per context length: the global and window layers' KV apart, their sum, and what the same
    layers would keep as global ones."""
    lines = [f"{'tokens':>10} {'batch':>6} {'global (GB)':>12} {'window (GB)':>12} {'KV (GB)':>12} {'KV (GiB)':>12} "
             f"{'all global (GB)':>16} {'share':>7}"]
    for num_tokens in tokens:
        total = shape.kv_cache_bytes(dtype_bytes, num_tokens, batch, dtype=dtype)
        unwindowed = shape.as_global().kv_cache_bytes(dtype_bytes, num_tokens, batch, dtype=dtype)
        lines.append(f"{num_tokens:>10,} {batch:>6} {shape.global_bytes(dtype_bytes, num_tokens, batch, dtype=dtype) / GB:>12,.2f} "
                     f"{shape.window_bytes(dtype_bytes, num_tokens, batch, dtype=dtype) / GB:>12,.2f} {total / GB:>12,.2f} "
                     f"{total / GIB:>12,.2f} {unwindowed / GB:>16,.2f} {total / unwindowed:>7.1%}")
    return lines


def _shape_line(shape: ModelShape) -> str:
    line = f"{shape.name}: {shape.num_layers} layers, {shape.num_heads} query heads, {shape.num_kv_heads} KV heads, head_dim {shape.head_dim}"
    if shape.v_head_dim is not None:
        line += f" (values {shape.v_head_dim})"
    if shape.kv_lora_rank is not None:
        line += f", latent {shape.kv_lora_rank} + rope {shape.qk_rope_head_dim}"
    return line


def _attention_line(shape: ModelShape) -> str:
    if shape.attention_kind == "MLA":
        return (f"attention: MLA, one latent of {shape.kv_lora_rank} + {shape.qk_rope_head_dim} values per token and layer "
                f"for all {shape.num_heads} heads: the KV cache is {shape.cache_saving:.1f}x smaller than with MHA")
    if shape.attention_kind == "MHA":
        return "attention: MHA (one KV head per query head; no GQA saving)"
    return (
        f"attention: {shape.attention_kind}, {shape.gqa_factor} query heads share each KV head: "
        f"the KV cache is {shape.gqa_factor}x smaller than with MHA"
    )


def _memory_lines(shape: ModelShape, tokens: Sequence[int], kv_dtype: str, memory_bytes: int, block_size: int) -> list[str]:
    dtype_bytes, dtype = KV_DTYPE_BYTES[kv_dtype], KV_DTYPE_NAMES[kv_dtype]
    num_blocks = num_blocks_for_memory(memory_bytes, shape, dtype_bytes, block_size, dtype=dtype)
    block_bytes = shape.bytes_per_block(dtype_bytes, block_size, dtype=dtype)
    lines = [
        f"memory {memory_bytes / GB:,.2f} GB ({memory_bytes / GIB:,.2f} GiB): {num_blocks:,} blocks of {block_size} tokens "
        f"({block_bytes / 10**6:,.3f} MB each) = {num_blocks * block_size:,} tokens",
    ]
    for num_tokens in tokens:
        blocks_per_request = blocks_per_decoding_request(shape, dtype_bytes, num_tokens, block_size, dtype=dtype)
        lines.append(f"  requests of {num_tokens:,} tokens that fit at once: {num_blocks // blocks_per_request:,}"
                     + (f" ({blocks_per_request:,} blocks each while decoding: a window layer group holds "
                        f"ceil(({shape.sliding_window:,} - 1) / {block_size}) + 1)" if shape.num_window_layers else ""))
    return lines


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _memory_size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
