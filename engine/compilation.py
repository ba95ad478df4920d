"""The compiled forward: torch.compile (inductor) applied to a loaded model by the runner.

The model stays plain nn.Module code. Each model gets one compiled function that runs any of its
decoder layers (regional compilation: the 30 layers share one graph, so compiling costs one
layer's worth, not the whole model's). Inside a layer inductor fuses what eager runs as ~25 small
ops: residual add + RMSNorm, rope, SiLU * up. Attention and the KV-cache write are custom ops
(kernels/custom_ops) and stay single nodes, so the graph does not break around them.

Row counts differ every step. Sizes are symbolic (`dynamic=True`), and "size-oblivious" so that
a batch of one request or a pure decode step (sizes and ints of 0 or 1) reuses the same graph:
measured, only a step of one token gets its own graph, which is what single-stream decode wants.
Weights and the KV cache's per-block shape never change, so they are marked static: no symbols,
size reads or guards for them.

A one-row decode step is overhead-bound: each of the 30 layer calls pays dynamo's guard check
before the graph runs. Of the ~190 guards a layer's graph gets, ~170 check what cannot change
for a given model (its modules' attributes and weights, the attention backend object, module
globals); only those on the per-call inputs are kept (`_per_call_guards`). That is safe because
each model's layers get their own compiled function (`isolate_recompiles`): no other model's
graph can be picked for them, and a model is not changed once compiled. Measured (tiny 30-layer
model, one row, interleaved): 17.8 -> 14.9 ms per forward.

Even with few guards, entering a compiled function costs ~120 us a layer call on this CPU (the
guard check, torch.compile's wrapper: config patches, eval-frame toggles, profiler regions), 3-4 ms
a step. So once the start-up warm-up has compiled the graphs a model needs, `bind_compiled_graphs`
points each layer straight at the code dynamo generated for them (the graph's input unpacking and
the compiled graph itself, as vLLM's custom dispatcher does). Which graph fits is still dynamo's
guards' answer, asked once per new combination of sizes (a quantized layer may branch on the row
count) instead of on every call. Measured (SmolLM2, one row, one layer, hot): 713 -> 597 us a call.

Inductor's caches live in the kvserve cache (KVSERVE_CACHE, default ~/.cache/kvserve), so the
next start skips code generation and C++ builds: a warm start compiles in seconds.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.types import GuardFilterEntry
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from kvserve.engine.model.protocol import CausalLM, Rope
from kvserve.kernels import AttentionBackend, AttentionMetadata, KVCache

logger = logging.getLogger(__name__)

CACHE_ENV = "KVSERVE_CACHE"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def kvserve_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvserve")


# Inductor's generated wrapper asserts every input's and custom op output's size and stride
# before each kernel (~20 checks a layer call): the kept guards check the per-call inputs
# already, the rest is fixed for the model. Measured (tiny 30-layer model, one row,
# interleaved): 14.6 -> 13.1 ms per forward.
SKIPPED_CHECKS = {"size_asserts": False, "alignment_asserts": False}

# The arguments of `_run_layer` that differ from call to call; guards on anything else are dropped.
PER_CALL_ARGUMENTS = frozenset({"x", "rope", "kv_cache", "meta"})
_ROOT_NAME = re.compile(r"\w*")


def _run_layer(layer: torch.nn.Module, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
               attention: AttentionBackend) -> torch.Tensor:
    return layer.forward(x, rope, kv_cache, meta, attention)


def _per_call_guards(entries: Sequence[GuardFilterEntry]) -> list[bool]:
    """Keeps the guards on the per-call arguments (their types, shapes, dtypes, strides) and the
    ones with no source (grad mode, default device, the shape relations that pick the one-token
    graph); drops those on the layer's modules, the attention backend and module globals."""
    return [not entry.name or _ROOT_NAME.match(entry.name).group(0) in PER_CALL_ARGUMENTS for entry in entries]


COMPILE_OPTIONS = {"guard_filter_fn": _per_call_guards, **SKIPPED_CHECKS}


def compile_layers(model: CausalLM) -> None:
    """Routes every decoder layer's call through one compiled function, private to this model.
    Call it once the model's modules are final (after any weight quantization or packing swapped
    them): a layer is traced as it is when first run, and later changes go unnoticed."""
    for layer in model.layers:
        for module in layer.modules():
            # Packed weights are plain tensor attributes, quantized ones buffers; parameters are static already.
            for tensor in (*vars(module).values(), *module.buffers(recurse=False)):
                if isinstance(tensor, torch.Tensor):
                    torch._dynamo.mark_static(tensor)
    run_layer = torch.compile(_run_layer, dynamic=True, isolate_recompiles=True, options=COMPILE_OPTIONS)
    for layer in model.layers:
        # What nn.Module.compile() sets, with the layer bound as the compiled function's argument.
        layer._compiled_call_impl = functools.partial(run_layer, layer)


def _graph_entries() -> list[Any]:
    """Dynamo's cache entries for `_run_layer` (every model's), one per compiled graph: each has
    the code dynamo generated (`code`) and its guards (`guard_manager`)."""
    return torch._dynamo.eval_frame._debug_get_cache_entry_list(_run_layer.__code__)


class _DirectLayerCalls:
    """One model's layer calls, straight into the compiled graph dynamo's guards pick for the
    call's sizes: the guards run once per new combination of sizes (rows, requests, block-table
    width; everything else a guard reads is fixed by how the runner builds its inputs), not on
    every call. Sizes no graph fits yet, and inputs of another dtype than the model's (not the
    runner's own forward), go through the guarded torch.compile path, which compiles as usual."""

    # Sizes remembered at most: a long-running server meets many (rows, requests, width)
    # combinations; past this many the memo starts over (a miss costs one guard check per graph).
    MAX_REMEMBERED_SIZES = 4096

    def __init__(self, guarded: Callable[..., torch.Tensor], dtype: torch.dtype, isolation_id: int) -> None:
        self.guarded, self.dtype, self.isolation_id = guarded, dtype, isolation_id
        self.graphs: dict[tuple[int, int, int], Callable[..., torch.Tensor]] = {}
        self.functions: dict[types.CodeType, Callable[..., torch.Tensor]] = {}  # one per graph

    def __call__(self, layer: torch.nn.Module, x: torch.Tensor, rope: Rope, kv_cache: KVCache,
                 meta: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        if x.dtype != self.dtype or rope[0].dtype != self.dtype:
            return self.guarded(layer, x, rope, kv_cache, meta, attention)
        sizes = (x.shape[0], meta.seq_lens.shape[0], meta.block_tables.shape[1])
        graph = self.graphs.get(sizes)
        if graph is None:
            frame = {"layer": layer, "x": x, "rope": rope, "kv_cache": kv_cache, "meta": meta, "attention": attention}
            graph = self._graph_for(frame)
            if graph is None:
                return self.guarded(layer, x, rope, kv_cache, meta, attention)
            if len(self.graphs) >= self.MAX_REMEMBERED_SIZES:
                self.graphs.clear()
            self.graphs[sizes] = graph
        return graph(layer, x, rope, kv_cache, meta, attention)

    def _graph_for(self, frame: dict[str, Any]) -> Callable[..., torch.Tensor] | None:
        for entry in _graph_entries():  # newest first, as dynamo tries them
            if entry.isolate_recompiles_id == self.isolation_id and entry.guard_manager.check(frame):
                if entry.code not in self.functions:
                    self.functions[entry.code] = types.FunctionType(entry.code, _direct_call_globals(entry.code),
                                                                    _run_layer.__name__)
                return self.functions[entry.code]
        return None


class _PregraphHelpers:
    """torch._dynamo.utils as the code dynamo generates before a graph (its "pre-graph bytecode":
    the graph's inputs read off the frame, between two profiler marks) calls it, with the helpers
    it calls on every call unwrapped from torch._disable_dynamo. That wrapper keeps dynamo from
    tracing a tensor subclass's __torch_function__ while a frame is being compiled; a direct layer
    call runs outside dynamo, on plain tensors, so there it only costs time: ~12 calls a layer
    call, ~1-2 us each (SmolLM2, one row, hot: 241 -> 223-228 us a layer call)."""

    UNWRAPPED = ("call_size", "call_stride", "call_storage_offset", "record_pregraph_bytecode_enter",
                 "record_pregraph_bytecode_exit")

    def __init__(self) -> None:
        utils = torch._dynamo.utils
        for name in self.UNWRAPPED:
            if hasattr(utils, name):
                helper = getattr(utils, name)
                setattr(self, name, getattr(helper, "__wrapped__", helper))

    def __getattr__(self, name: str) -> Any:  # anything else: dynamo's own
        return getattr(torch._dynamo.utils, name)


_PREGRAPH_HELPERS = _PregraphHelpers()
_DYNAMO_UTILS_GLOBAL = re.compile(r"__import_torch_dot__dynamo_dot_utils(_\d+)?$")


def _direct_call_globals(code: types.CodeType) -> dict[str, Any]:
    """The globals a graph's code runs with when called directly: _run_layer's (where dynamo put
    the compiled graph and the modules the code loads), torch._dynamo.utils swapped for
    _PregraphHelpers."""
    names = [name for name in code.co_names if _DYNAMO_UTILS_GLOBAL.match(name)]
    if not names:
        return _run_layer.__globals__
    return {**_run_layer.__globals__, **dict.fromkeys(names, _PREGRAPH_HELPERS)}


def bind_compiled_graphs(model: CausalLM, warm_ups: Sequence[Callable[[], None]]) -> bool:
    """Runs the warm-up forwards of a model passed to `compile_layers` (each compiles or loads
    the graph of one kind of step), then routes its layer calls straight into their graphs
    (_DirectLayerCalls): no torch.compile wrapper, and guards only on new sizes. Where the
    warm-up compiled nothing new of its own (the layers were bound already, or torch's internals
    changed), they keep the guarded path; returns whether it bound."""
    before = {entry.code for entry in _graph_entries()}
    for warm_up in warm_ups:
        warm_up()
    isolation_ids = {entry.isolate_recompiles_id for entry in _graph_entries() if entry.code not in before}
    if len(isolation_ids) != 1:
        logger.info("compiled layers stay behind torch.compile's guards: the warm-up compiled no graphs of their own")
        return False
    guarded = model.layers[0]._compiled_call_impl.func  # the torch.compile'd _run_layer
    # The dtype of every hidden state and rope table the model's forward makes.
    calls = _DirectLayerCalls(guarded, model.dtype, isolation_ids.pop())
    for layer in model.layers:
        layer._compiled_call_impl = functools.partial(calls, layer)
    return True


def mark_cache_shapes_static(kv_caches: Sequence[KVCache]) -> None:
    """A cache's heads, block size and head size are fixed for the model; the number of blocks
    (sized from free memory) stays symbolic, so that a start with another cache size reuses
    the compiled code from the disk cache."""
    for cache in kv_caches:
        for tensor in cache:
            for dim in range(1, tensor.dim()):
                torch._dynamo.mark_static(tensor, dim)


@contextmanager
def symbolic_sizes() -> Iterator[None]:
    """Wrap every call of a compiled model in this: a (re)compile happening inside treats sizes
    of 0 and 1 like any other, instead of specialising a graph for them, and gives sizes that
    happen to be equal (rows, requests, block-table width) their own symbols instead of
    guarding on the coincidence. Floats (RMSNorm's eps) stay constants of the graph rather than
    a tensor argument built on every call."""
    with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False), \
            torch._dynamo.config.patch(specialize_float=True):
        yield


def compile_at_start_up(warm_up: Callable[[], None]) -> None:
    """Compiles by running `warm_up` (forwards that reach every graph), with inductor's caches
    (FX graphs, AOT autograd, C++ kernels) under the kvserve cache unless TORCHINDUCTOR_CACHE_DIR
    says otherwise. Inductor keys its entries by graph, torch version and settings, so a second
    start with the same model, dtype and kernels only re-traces (seconds)."""
    # Inductor reads this variable whenever it opens its cache (its only setting for it), and
    # writes its /tmp default there on first use (the C++ kernel build may have done so already):
    # only a value the user chose is kept.
    cache = os.environ.get(INDUCTOR_CACHE_ENV)
    if cache is None or cache == os.path.abspath(default_cache_dir()):
        cache = os.environ[INDUCTOR_CACHE_ENV] = str(kvserve_cache_dir() / "inductor")
    logger.info("compiling the forward with torch.compile (cache: %s; --enforce-eager skips this)", cache)
    start = time.perf_counter()
    before = _graph_cache_counts()
    warm_up()
    hits, misses = (after - earlier for after, earlier in zip(_graph_cache_counts(), before))
    # The counts show whether a start found its graphs in the cache (a warm start, e.g. an image
    # whose cache was filled at build time) or compiled them.
    logger.info("forward compiled in %.1f s (inductor's graph cache: %d hits, %d misses)",
                time.perf_counter() - start, hits, misses)


def _graph_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
