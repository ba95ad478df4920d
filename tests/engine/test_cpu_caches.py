"""The CPU libraries' per-shape caches are capped unless the operator set their own caps."""

from __future__ import annotations

from kvserve.engine.cpu_caches import CACHE_CAPACITY, limit_cpu_caches


def test_unset_caps_get_the_default_and_set_ones_are_kept() -> None:
    environ = {"LRU_CACHE_CAPACITY": "512", "PATH": "/bin"}
    assert limit_cpu_caches(environ) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(CACHE_CAPACITY),
                                         "LRU_CACHE_CAPACITY": "512"}
    assert environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(CACHE_CAPACITY) and environ["PATH"] == "/bin"
