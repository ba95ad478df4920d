"""The paged KV cache's memory, laid out as a KVCacheConfig plans it (paging/kv_cache_spec.py).

    slot j:   K [num_blocks, page]   V [num_blocks, page]     (one pair per slot)
    layer:    the j-th layer of group g reads slot j, viewed as [num_blocks, kv_heads, block_size, head_dim]

Block id b's page in a slot belongs to whichever group holds block b, so groups share the pool.
A layer whose page is smaller than the slot's views the first part of each page: its block
stride stays the page, which every kernel takes from the tensor's strides. One group (a plain
decoder) is one slot per layer, each viewed whole: exactly a [num_blocks, Hkv, block_size, D]
tensor per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels import KVCache
from kvserve.paging import KVCacheConfig


@dataclass(frozen=True)
class KVCacheTensors:
    slots: list[KVCache]  # (K, V) raw pages per slot
    layers: list[KVCache]  # (K, V) views per layer, in layer order
    group_of_layer: list[int]

    @classmethod
    def allocate(cls, config: KVCacheConfig, dtype: torch.dtype, device: torch.device) -> "KVCacheTensors":
        if config.page_bytes % (2 * dtype.itemsize):
            raise ValueError(f"a page of {config.page_bytes} bytes does not hold whole {dtype} keys and values")
        page = config.page_bytes // (2 * dtype.itemsize)  # elements of K (and of V) per block per slot
        # Zeros, not empty: padded rows of a batched read point at whatever block 0 holds, and a
        # masked NaN would still poison the weighted sum of values.
        slots = [(torch.zeros(config.num_blocks, page, dtype=dtype, device=device),
                  torch.zeros(config.num_blocks, page, dtype=dtype, device=device)) for _ in range(config.num_slots)]
        layers, group_of_layer = [], []
        for group_index, slot in config.slot_of_layer():
            spec = config.groups[group_index].spec
            shape = (config.num_blocks, spec.num_kv_heads, config.block_size, spec.head_size)
            elements = spec.num_kv_heads * config.block_size * spec.head_size
            key, value = slots[slot]
            layers.append((key[:, :elements].view(shape), value[:, :elements].view(shape)))
            group_of_layer.append(group_index)
        return cls(slots, layers, group_of_layer)

    @property
    def num_bytes(self) -> int:
        return sum(2 * key.numel() * key.element_size() for key, _ in self.slots)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's pages, in every slot (whichever group
        holds the block, its layers' K/V live at that block id in each slot)."""
        device = self.slots[0][0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for key, value in self.slots:
            key[dst] = key[src]
            value[dst] = value[src]
