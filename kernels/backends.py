"""Attention backends: the two implementations of one contract, and the choice between them.

The engine holds one backend object and calls `write_kv_cache` / `paged_attention` on it every
layer; which one it holds is decided once, from the device and the `--attention-backend` option.
Both call the kernels through their custom ops (custom_ops.py), so a compiled forward keeps one
graph around them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.kernels import custom_ops
from kvserve.kernels.cpu_attention import cpu_kernel_available, cpu_kernel_supports
from kvserve.kernels.kv_quant import check_scale

BACKEND_NAMES = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    name: str

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        *,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        num_decodes: int | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> torch.Tensor:
        """`num_decodes`, when given, says that requests [0, num_decodes) are single-query
        decodes in query rows [0, num_decodes) and the rest are prompt chunks."""
        ...


@dataclass(frozen=True)
class TorchAttentionBackend:
    """The CPU path (the C++ kernel where it builds, plain torch otherwise). `validate=False`
    skips the per-call checks of the metadata's values: the engine builds and checks its
    metadata once per step, so its layers need not re-read it 2 x 30 times.

    Unvalidated CPU calls go straight to the C++ ops (`native`, decided once here, so a compiled
    forward sees a constant): they skip the Python op and the entry point's checks, ~15 us a call
    that a one-row decode step pays 60 times. The kernel still bounds-checks every shape, block
    id, slot and length it reads."""

    validate: bool = True
    name: str = "torch"
    native: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "native", not self.validate and cpu_kernel_available())

    def write_kv_cache(self, key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
        if self.native and key.device.type == "cpu":
            torch.ops.kvserve_cpu.write_kv_cache(key, value, key_cache, value_cache, slot_mapping,
                                                 check_scale("k_scale", k_scale), check_scale("v_scale", v_scale))
            return
        custom_ops.torch_write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, self.validate)

    def paged_attention(
        self, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        *, max_query_len=None, max_seq_len=None, num_decodes=None, k_scale=None, v_scale=None,
    ) -> torch.Tensor:
        if self.native and query.device.type == "cpu" and cpu_kernel_supports(query.shape[-1]):
            # k_scale multiplies every score, v_scale every output: folded in, the cache is never touched.
            return torch.ops.kvserve_cpu.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                                         scale * check_scale("k_scale", k_scale), check_scale("v_scale", v_scale))
        return custom_ops.torch_paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            max_query_len, max_seq_len, num_decodes, k_scale, v_scale, self.validate,
        )


@dataclass(frozen=True)
class TritonAttentionBackend:
    """Triton kernels: the GPU path. `debug=True` also checks slots and block tables against the
    cache on every call (a host sync per call: for hunting bugs, not for serving)."""

    debug: bool = False
    name: str = "triton"

    def write_kv_cache(self, key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
        custom_ops.triton_write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, self.debug)

    def paged_attention(
        self, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        *, max_query_len=None, max_seq_len=None, num_decodes=None, k_scale=None, v_scale=None,
    ) -> torch.Tensor:
        return custom_ops.triton_paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            max_query_len, max_seq_len, num_decodes, k_scale, v_scale, self.debug,
        )


def select_attention_backend(name: str, device: torch.device, *, debug: bool = False) -> AttentionBackend:
    """"auto": Triton on CUDA, torch elsewhere; "torch" / "triton" force one. `debug` checks
    every call's metadata values (the engine builds its metadata checked, once per step)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    device = torch.device(device)
    triton_installed = importlib.util.find_spec("triton") is not None
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_installed else "torch"
    if name == "torch":
        return TorchAttentionBackend(validate=debug)
    if not triton_installed:
        raise RuntimeError("the triton attention backend needs the `triton` package: pip install triton, or use --attention-backend torch")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"the triton attention backend needs a CUDA device, got {device}; use --attention-backend torch, "
            "or set TRITON_INTERPRET=1 before kvserve is imported to run the kernels in Triton's (very slow) interpreter"
        )
    return TritonAttentionBackend(debug=debug)
