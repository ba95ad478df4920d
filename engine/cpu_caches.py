"""Caps on the CPU math libraries' per-shape caches, set before the engine's first matmul.

oneDNN keeps each primitive it creates (one per matmul shape) in a cache of
ONEDNN_PRIMITIVE_CACHE_CAPACITY entries, and torch's ideep layer above it keeps its own LRU of
computations (LRU_CACHE_CAPACITY); both default to 1024. A server meets a new shape whenever a
step's row count is new (decode batch sizes, prompt chunk lengths), and with the default model
each shape holds ~0.6 MB in the two caches together, so RSS grows by hundreds of MB before the caches fill
(300 row counts: +705 MiB; capped at 64 each: +76 MiB, flat after ~100 row counts;
benchmarks/onednn_cache.py). A step uses about five shapes (four per layer, lm_head), so 64
entries hold a dozen recent step sizes; a shape evicted and met again is re-created from
oneDNN's kernel cache (its JIT code is kept apart), which costs far less than the first time.

Both libraries read their variable once, at first use, so this runs before the model loads; a
value already in the environment (the operator's) wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CACHE_CAPACITY = 64
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def limit_cpu_caches(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Sets each cap the environment does not set; returns the values in effect."""
    for name in CACHE_VARIABLES:
        environ.setdefault(name, str(CACHE_CAPACITY))
    return {name: environ[name] for name in CACHE_VARIABLES}
