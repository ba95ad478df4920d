"""Attention backends: the two implementations of one contract, and the choice between them.

The engine holds one backend object; each step it runs `prepare` on the step's metadata, and every
layer calls `write_kv_cache` / `paged_attention` with it; which backend it holds is decided once,
from the device and the `--attention-backend` option (and an fp8 cache's scales, which the
backend passes to every kernel call, so the model never knows how its cache is stored). Both
call the kernels through their custom ops (custom_ops.py), so a compiled forward keeps one graph
around them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.kernels import custom_ops
from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.cpu_attention import cpu_kernel_available, cpu_kernel_supports
from kvserve.kernels.kv_quant import check_scale, row_scales

BACKEND_NAMES = ("auto", "torch", "triton")


# (key_cache, value_cache): [num_blocks, Hkv, block_size, D]; a latent (MLA) layer's value cache
# is a view of its key cache's first kv_lora_rank values (one shared head, key width != value width).
# An int8 layer's is (key_cache, value_cache, key_scales, value_scales), the scales
# [num_blocks, Hkv, block_size] float32, or their bytes [..., 4] int8 as the engine's pages hold
# them (kv_quant.row_scales): the kernels read either.
KVCache = tuple[torch.Tensor, ...]


def unpack_cache(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(key_cache, value_cache, key_scales, value_scales); the scales None but for int8 caches."""
    if len(kv_cache) == 4:
        return kv_cache  # type: ignore[return-value]
    key_cache, value_cache = kv_cache
    return key_cache, value_cache, None, None


class AttentionBackend(Protocol):
    """What a model's attention layers call. The step's metadata goes through `prepare` once
    (per layer group) before the first layer, then whole to every call: a backend unpacks it in
    one place, and does its per-step work (launch planning, buffers) once, not per layer."""

    name: str

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata: ...

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                       metadata: AttentionMetadata) -> None:
        """Scatter this step's K/V rows ([tokens, kv_heads, head_dim]) into their slots (a latent
        cache: the latents as keys, and their first kv_lora_rank values as values, written once)."""
        ...

    def paged_attention(self, query: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                        scale: float, soft_cap: float = 0.0) -> torch.Tensor:
        """query [tokens, heads, key head_dim] -> the attention output [tokens, heads, value head_dim].
        `soft_cap` c > 0: each scaled score s becomes c * tanh(s / c) before the softmax (a
        layer's property, as Gemma 2's attn_logit_softcapping; 0: none)."""
        ...


@dataclass(frozen=True)
class TorchAttentionBackend:
    """The CPU path (the C++ kernel where it builds, plain torch otherwise). `validate=False`
    skips the per-call checks of the metadata's values: the engine builds and checks its
    metadata once per step, so its layers need not re-read it 2 x 30 times.

    Unvalidated CPU calls go straight to the C++ ops (`native`, decided once here, so a compiled
    forward sees a constant): they skip the Python op and the entry point's checks, ~15 us a call
    that a one-row decode step pays 60 times. The kernel still bounds-checks every shape, block
    id, slot and length it reads.

    `k_scale` / `v_scale`: an fp8 cache's static quantisation scales (None: an unscaled cache;
    an int8 cache brings its per-row scales in the KVCache)."""

    validate: bool = True
    k_scale: float | None = None
    v_scale: float | None = None
    name: str = "torch"
    native: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "native", not self.validate and cpu_kernel_available())
        check_scale("k_scale", self.k_scale)
        check_scale("v_scale", self.v_scale)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        return metadata  # the C++ kernel splits its work per call, in microseconds

    def write_kv_cache(self, key, value, kv_cache, metadata) -> None:
        key_cache, value_cache, key_scales, value_scales = unpack_cache(kv_cache)
        if self.native and key.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
            torch.ops.kvserve_cpu.write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping,
                                                 check_scale("k_scale", self.k_scale), check_scale("v_scale", self.v_scale),
                                                 key_scales, value_scales)
            return
        custom_ops.torch_write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping, self.k_scale,
                                        self.v_scale, key_scales, value_scales, self.validate)

    def paged_attention(self, query, kv_cache, metadata, scale, soft_cap=0.0) -> torch.Tensor:
        key_cache, value_cache, key_scales, value_scales = unpack_cache(kv_cache)
        m = metadata
        if self.native and query.device.type == "cpu" and cpu_kernel_supports(key_cache.shape[-1], value_cache.shape[-1]):
            # k_scale multiplies every score, v_scale every output: folded in, the cache is never touched.
            return torch.ops.kvserve_cpu.paged_attention(query, key_cache, value_cache, m.block_tables, m.seq_lens,
                                                         m.query_start_loc, scale * check_scale("k_scale", self.k_scale),
                                                         check_scale("v_scale", self.v_scale), m.sliding_window, soft_cap,
                                                         key_scales, value_scales)
        return custom_ops.torch_paged_attention(
            query, key_cache, value_cache, m.block_tables, m.seq_lens, m.query_start_loc, scale,
            m.max_query_len, m.max_seq_len, m.num_decodes, self.k_scale, self.v_scale, m.sliding_window, soft_cap,
            key_scales, value_scales, self.validate,
        )


@dataclass(frozen=True)
class TritonAttentionBackend:
    """Triton kernels: the GPU path. `debug=True` also checks slots and block tables against the
    cache on every call (a host sync per call: for hunting bugs, not for serving). `prepare`
    gives each step one StepLaunches: the first layer checks shapes, plans the launch and
    allocates the split-KV buffers, and the step's other layers reuse them."""

    debug: bool = False
    k_scale: float | None = None
    v_scale: float | None = None
    name: str = "triton"

    def __post_init__(self) -> None:
        check_scale("k_scale", self.k_scale)
        check_scale("v_scale", self.v_scale)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        from kvserve.kernels.triton_attention import StepLaunches  # triton is imported lazily

        return dataclasses.replace(metadata, prepared=StepLaunches())

    def write_kv_cache(self, key, value, kv_cache, metadata) -> None:
        key_cache, value_cache, key_scales, value_scales = unpack_cache(kv_cache)
        custom_ops.triton_write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping, self.k_scale,
                                         self.v_scale, key_scales, value_scales, self.debug)

    def paged_attention(self, query, kv_cache, metadata, scale, soft_cap=0.0) -> torch.Tensor:
        key_cache, value_cache, key_scales, value_scales = unpack_cache(kv_cache)
        m = metadata
        if m.prepared is not None and not torch.compiler.is_compiling():
            # Eager: the kernel's Python entry point directly, with the step's launches. (A
            # compiled graph keeps the custom op, one opaque node that plans for itself.)
            from kvserve.kernels.triton_attention import triton_paged_attention

            return triton_paged_attention(
                query, key_cache, value_cache, m.block_tables, m.seq_lens, m.query_start_loc, scale,
                max_query_len=m.max_query_len, max_seq_len=m.max_seq_len, num_decodes=m.num_decodes,
                k_scale=self.k_scale, v_scale=self.v_scale, sliding_window=m.sliding_window, soft_cap=soft_cap,
                key_scales=row_scales(key_scales), value_scales=row_scales(value_scales), check_block_tables=self.debug,
                launches=m.prepared,
            )
        return custom_ops.triton_paged_attention(
            query, key_cache, value_cache, m.block_tables, m.seq_lens, m.query_start_loc, scale,
            m.max_query_len, m.max_seq_len, m.num_decodes, self.k_scale, self.v_scale, m.sliding_window, soft_cap,
            key_scales, value_scales, self.debug,
        )


def select_attention_backend(name: str, device: torch.device, *, debug: bool = False,
                             kv_scales: tuple[float, float] | None = None) -> AttentionBackend:
    """"auto": Triton on CUDA, torch elsewhere; "torch" / "triton" force one. `debug` checks
    every call's metadata values (the engine builds its metadata checked, once per step).
    `kv_scales`: (k_scale, v_scale) of an fp8 cache."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    device = torch.device(device)
    triton_installed = importlib.util.find_spec("triton") is not None
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_installed else "torch"
    k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
    if name == "torch":
        return TorchAttentionBackend(validate=debug, k_scale=k_scale, v_scale=v_scale)
    if not triton_installed:
        raise RuntimeError("the triton attention backend needs the `triton` package: pip install triton, or use --attention-backend torch")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"the triton attention backend needs a CUDA device, got {device}; use --attention-backend torch, "
            "or set TRITON_INTERPRET=1 before kvserve is imported to run the kernels in Triton's (very slow) interpreter"
        )
    return TritonAttentionBackend(debug=debug, k_scale=k_scale, v_scale=v_scale)
