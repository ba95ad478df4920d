"""kvserve.paging: the paged KV cache's bookkeeping (pure Python, no torch).

The scheduler uses one facade, `KVCacheManager`; the engine plans the cache from its layers'
specs with `kv_cache_spec.plan_kv_cache_config`.
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
from kvserve.paging.kv_cache_manager import NO_NEW_BLOCKS, GroupBlockIds, KVCacheManager, KVCacheStats
from kvserve.paging.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    group_layers,
    plan_kv_cache_config,
)
from kvserve.paging.prefix_cache import PrefixCache

__all__ = [
    "NO_NEW_BLOCKS",
    "SUPPORTED_BLOCK_SIZES",
    "BlockAllocator",
    "BlockAllocatorError",
    "BlockTable",
    "FullAttentionSpec",
    "GroupBlockIds",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheStats",
    "KVCacheTooSmallError",
    "MLAAttentionSpec",
    "NoFreeBlocksError",
    "PagingError",
    "PrefixCache",
    "SlidingWindowSpec",
    "UnknownRequestError",
    "group_layers",
    "plan_kv_cache_config",
]
