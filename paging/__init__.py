"""kvserve.paging: the paged KV cache's bookkeeping (pure Python, no torch).

The scheduler uses one facade, `KVCacheManager`; the engine sizes the cache with `kv_sizing`.
"""

from kvserve.paging.block_allocator import SUPPORTED_BLOCK_SIZES, BlockAllocator
from kvserve.paging.block_table import BlockTable
from kvserve.paging.errors import (
    BlockAllocatorError,
    KVCacheTooSmallError,
    NoFreeBlocksError,
    PagingError,
    UnknownRequestError,
)
from kvserve.paging.kv_cache_manager import KVCacheManager, KVCacheStats
from kvserve.paging.prefix_cache import PrefixCache

__all__ = [
    "SUPPORTED_BLOCK_SIZES",
    "BlockAllocator",
    "BlockAllocatorError",
    "BlockTable",
    "KVCacheManager",
    "KVCacheStats",
    "KVCacheTooSmallError",
    "NoFreeBlocksError",
    "PagingError",
    "PrefixCache",
    "UnknownRequestError",
]
