"""The paged KV cache's memory, laid out as a KVCacheConfig plans it (paging/kv_cache_spec.py).

    slot j:   planes [num_blocks, plane] ...     (K pages and V pages, or one plane of whole pages)
    layer:    the j-th layer of group g reads slot j through views of its page's parts:
        full attention   K, V  [num_blocks, kv_heads, block_size, head_dim]
        latent (MLA)     one latent [num_blocks, 1, block_size, kv_lora_rank + rope_dim], read
                         as keys (all of it) and values (its first kv_lora_rank values): a single
                         shared KV head whose key and value widths differ
        int8             K, V as above, and after each part's rows their float32 scales, viewed
                         as their bytes [num_blocks, kv_heads, block_size, 4] int8 (a compiled
                         forward cannot mutate a float32 view of int8 storage; the kernels read
                         the bytes as floats: kernels/kv_quant.row_scales)

Block id b's page in a slot belongs to whichever group holds block b, so groups share the pool.
A part smaller than its plane's page views the first part of each page (or its offset in a
page of several parts): its block stride stays the page, which every kernel takes from the
tensor's strides. One group of full attention (a plain decoder) is two planes per layer, each
viewed whole: exactly a [num_blocks, Hkv, block_size, D] tensor for K and one for V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine import huge_pages
from kvserve.kernels import KVCache
from kvserve.paging import KVCacheConfig, KVCacheSpec, MLAAttentionSpec


def layer_cache(spec: KVCacheSpec, parts: list[torch.Tensor], block_size: int) -> KVCache:
    """A layer's (key, value) cache from its page parts ([num_blocks, part elements] each)."""
    num_blocks = parts[0].shape[0]
    if isinstance(spec, MLAAttentionSpec):
        (latent,) = parts
        latent = latent.view(num_blocks, 1, block_size, spec.latent_size)
        # The values are the latents' first kv_lora_rank values: a view, not a second copy.
        return latent, latent[..., : spec.kv_lora_rank]
    shape = (num_blocks, spec.num_kv_heads, block_size, spec.head_size)
    if not spec.row_scale_bytes:
        key, value = parts
        return key.view(shape), value.view(shape)
    # int8: each part is the rows (one byte per value), then one float32 scale per row.
    rows = spec.num_kv_heads * block_size * spec.head_size
    caches = [part[:, :rows].view(shape) for part in parts]
    scales = [part[:, rows:].view(*shape[:3], spec.row_scale_bytes) for part in parts]
    if any(s.data_ptr() % 4 or s.stride(0) % 4 for s in scales):  # the kernels read them as floats
        raise ValueError(f"an int8 cache of {spec.num_kv_heads} heads x {block_size} tokens x {spec.head_size} dims "
                         "does not leave its scales 4-byte aligned")
    return caches[0], caches[1], scales[0], scales[1]


@dataclass(frozen=True)
class KVCacheTensors:
    slots: list[tuple[torch.Tensor, ...]]  # raw planes per slot
    layers: list[KVCache]  # (K, V) views per layer, in layer order
    group_of_layer: list[int]

    @classmethod
    def allocate(cls, config: KVCacheConfig, dtype: torch.dtype, device: torch.device) -> "KVCacheTensors":
        item = dtype.itemsize
        parts_bytes = [size for g in range(len(config.groups)) for _, offset, size in config.part_places(g)]
        if config.plane_bytes % item or any(size % item for size in parts_bytes):
            raise ValueError(f"pages of {config.plane_bytes} bytes do not hold whole {dtype} elements in each part")
        plane = config.plane_bytes // item  # elements per block per plane
        # Zeros, not empty: padded rows of a batched read point at whatever block 0 holds, and a
        # masked NaN would still poison the weighted sum of values. On huge pages where Linux
        # gives them on request (huge_pages.py: decodes read blocks scattered over gigabytes).
        slots = [tuple(huge_pages.zeros((config.num_blocks, plane), dtype, device) for _ in range(config.num_planes))
                 for _ in range(config.num_slots)]
        layers, group_of_layer = [], []
        for group_index, slot in config.slot_of_layer():
            parts = [slots[slot][plane_index][:, offset // item:(offset + size) // item]
                     for plane_index, offset, size in config.part_places(group_index)]
            layers.append(layer_cache(config.groups[group_index].spec, parts, config.block_size))
            group_of_layer.append(group_index)
        return cls(slots, layers, group_of_layer)

    @property
    def num_bytes(self) -> int:
        return sum(plane.numel() * plane.element_size() for planes in self.slots for plane in planes)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's pages, in every slot (whichever group
        holds the block, its layers' caches live at that block id in each slot)."""
        device = self.slots[0][0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for planes in self.slots:
            for plane in planes:
                plane[dst] = plane[src]
