"""The compiled forward: torch.compile (inductor) applied to a loaded model by the runner.

The model stays plain nn.Module code. Each decoder layer is compiled in place (regional
compilation: the 30 layers share one compiled graph, so compiling costs one layer's worth, not
the whole model's). Inside a layer inductor fuses what eager runs as ~25 small ops: residual add
+ RMSNorm, rope, SiLU * up. Attention and the KV-cache write are custom ops (kernels/custom_ops)
and stay single nodes, so the graph does not break around them.

Row counts differ every step. Sizes are symbolic (`dynamic=True`), and "size-oblivious" so that
a batch of one request or a pure decode step (sizes and ints of 0 or 1) reuses the same graph:
measured, only a step of one token gets its own graph, which is what single-stream decode wants.

Inductor's caches live in the kvserve cache (KVSERVE_CACHE, default ~/.cache/kvserve), so the
next start skips code generation and C++ builds: a warm start compiles in seconds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from kvserve.engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

CACHE_ENV = "KVSERVE_CACHE"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
RECOMPILE_LIMIT = 64


def kvserve_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvserve")


def compile_layers(model: LlamaForCausalLM) -> None:
    """Compiles every decoder layer in place. Call it once the model's modules are final (after
    any weight quantization swapped them), since a layer is traced as it is when first run."""
    for layer in model.layers:
        layer.compile(dynamic=True)


@contextmanager
def symbolic_sizes() -> Iterator[None]:
    """Wrap every call of a compiled model in this: a (re)compile happening inside treats sizes
    of 0 and 1 like any other, instead of specialising a graph for them, and gives sizes that
    happen to be equal (rows, requests, block-table width) their own symbols instead of
    guarding on the coincidence. Each model set-up (dtype, KV dtype, shapes) adds two graphs
    to the layer's code, so a process with several engines needs more than dynamo's default 8."""
    with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False), \
            torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
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
    warm_up()
    logger.info("forward compiled in %.1f s", time.perf_counter() - start)
