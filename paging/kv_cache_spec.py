"""What each attention layer keeps in the KV cache, and how layers share one pool of blocks.

Every attention layer declares a spec (what one token costs it, and which tokens it needs).
Layers with equal specs form a group; each request keeps one block table per group, and all
groups draw block ids from one shared pool:

    layer:   0     1     2     3     4     5          (a model whose layers differ: specs A and B)
    spec:    A     A     B     A     A     B
    groups:  g0 = layers (0, 1)  g1 = layers (3, 4)  g2 = layers (2, 5)     (2 layers each)
    slots:   slot 0 holds layers 0, 3, 2   slot 1 holds layers 1, 4, 5

Memory is `num_slots` slots of `num_blocks` pages (vLLM v1's layout): a slot's page at block
id b belongs to whichever group holds block b, and each group reads slot j as its j-th layer.
A block id therefore costs one page in every slot, whoever holds it, and no memory sits reserved
for a group that is not using it. Groups are made equally large (layers of a kind split into
groups of the smallest kind's size) so that slots are not wasted on small groups; a page is the
largest group's page, so layers with a smaller page leave the rest of it unused.

A spec says how its page splits into parts (`page_parts`): full attention's into K and V, a
latent (MLA) layer's not at all. When every group splits its page alike, a slot is that many
planes (K pages in one tensor, V pages in another: each part's blocks stay evenly strided and
as close as the page allows, the kernels' fastest layout); when the kinds differ (K/V layers
beside latent ones), a slot is one plane and a page holds its parts side by side.

An int8 cache keeps a float32 scale per token and KV head beside its values (ROW_SCALE_BYTES):
each K or V part of a page is that layer's rows, then their scales, so every block operation
(allocation, copy-on-write, prefix sharing, window groups) moves the scales with the rows.

Pure Python (no torch): the engine maps `dtype` names to tensor types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.paging.block_allocator import validate_block_size
from kvserve.paging.errors import KVCacheTooSmallError


# Cache dtypes whose rows are quantised one (token, KV head) row at a time, and the bytes of each
# row's scale (kernels/kv_quant.py): stored in the page after the rows they scale.
ROW_SCALE_BYTES = {"int8": 4}


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that keeps the key and value of every token: num_kv_heads x head_size each."""

    num_kv_heads: int
    head_size: int
    dtype: str  # the cache element type, as torch names it without "torch." ("bfloat16", "float8_e4m3fn")
    dtype_bytes: int

    kind = "full attention"

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be at least 1, got {getattr(self, name)}")

    @property
    def row_scale_bytes(self) -> int:
        """Bytes of one row's scale (an int8 cache's float32), 0 for caches without."""
        return ROW_SCALE_BYTES.get(self.dtype, 0)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one layer (with their scales, in an int8 cache)."""
        return 2 * self.num_kv_heads * (self.head_size * self.dtype_bytes + self.row_scale_bytes)

    def page_bytes(self, block_size: int) -> int:
        """One layer's share of one block."""
        return self.bytes_per_token * block_size

    def page_parts(self, block_size: int) -> tuple[int, ...]:
        """The page's parts in bytes, in order: the keys, then the values (each with its rows' scales)."""
        half = self.page_bytes(block_size) // 2
        return half, half

    def max_num_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int | None = None) -> int:
        """Blocks a request of `num_tokens` tokens holds at once in a group of this kind, when a
        step computes at most `max_step_tokens` of them (None: any number)."""
        return -(-num_tokens // block_size)


@dataclass(frozen=True)
class MLAAttentionSpec:
    """A multi-head latent attention layer (DeepSeek-V2/V3): one latent vector per token and no
    heads: the compressed KV (kv_lora_rank values, normalised) and the decoupled rope key
    (qk_rope_head_dim values), which every query head reads. Keys are the whole vector, values its
    first kv_lora_rank values (the absorbed form: attention with one shared KV head). It pages
    like full attention: every block of the prefix is needed, none is given back early."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str
    dtype_bytes: int

    kind = "latent attention (MLA)"

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be at least 1, got {getattr(self, name)}")

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        """One latent vector: (kv_lora_rank + qk_rope_head_dim) x dtype bytes."""
        return self.latent_size * self.dtype_bytes

    def page_bytes(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def page_parts(self, block_size: int) -> tuple[int, ...]:
        """One part: the latents (keys and values are both read out of it)."""
        return (self.page_bytes(block_size),)

    def max_num_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int | None = None) -> int:
        return -(-num_tokens // block_size)



@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A layer that attends to the last `sliding_window` positions, its own included (query p
    reads keys p - w + 1 .. p, as transformers' sliding-window mask and Mistral's
    `sliding_window` mean it). Its group gives back blocks that fell wholly out of the window
    while the request runs (paging/single_type_manager.py: SlidingWindowManager)."""

    sliding_window: int

    kind = "sliding window"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"SlidingWindowSpec.sliding_window must be at least 1, got {self.sliding_window}")

    def max_num_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int | None = None) -> int:
        """A step computing n tokens at positions c .. c+n-1 reads from c - w + 1 on: a span of
        w + n - 1 positions, which touches at most ceil((w + n - 2) / block_size) + 1 blocks
        (ceil((w - 1) / 16) + 1 for a decode), and never more than the whole request's."""
        step = num_tokens if max_step_tokens is None else max(1, min(max_step_tokens, num_tokens))
        window = -(-(self.sliding_window + step - 2) // block_size) + 1
        return min(-(-num_tokens // block_size), window)


# The kinds a layer can declare.
KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share a spec and therefore one block table per request."""

    layer_indices: tuple[int, ...]
    spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole cache: how many blocks, and which layers read which group's tables from which slot."""

    num_blocks: int
    block_size: int
    groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        # Any positive size: the allocator and the CLI hold users to SUPPORTED_BLOCK_SIZES; the
        # runner's tests use blocks of 4 to cross block boundaries with tiny prompts.
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {self.num_blocks}")
        if not self.groups:
            raise ValueError("a KV cache needs at least one layer group")
        layers = sorted(i for group in self.groups for i in group.layer_indices)
        if layers != list(range(len(layers))):
            raise ValueError(f"every layer must be in exactly one group, got layers {layers}")

    @property
    def num_layers(self) -> int:
        return sum(len(group.layer_indices) for group in self.groups)

    @property
    def num_slots(self) -> int:
        """Per-layer tensors of num_blocks pages; slot j holds the j-th layer of every group."""
        return max(len(group.layer_indices) for group in self.groups)

    @property
    def page_bytes(self) -> int:
        return max(group.spec.page_bytes(self.block_size) for group in self.groups)

    @property
    def num_planes(self) -> int:
        """Tensors per slot: every group's page parts in planes of their own, when they all split
        their pages alike; otherwise one plane holding each page whole."""
        return num_planes(self.groups, self.block_size)

    @property
    def plane_bytes(self) -> int:
        """One block's bytes in one plane of one slot."""
        return plane_bytes(self.groups, self.block_size)

    def part_places(self, group_index: int) -> list[tuple[int, int, int]]:
        """Where each of a group's page parts lives in a slot: (plane, byte offset in the
        plane's page, bytes), in the spec's part order."""
        parts = self.groups[group_index].spec.page_parts(self.block_size)
        if self.num_planes > 1:
            return [(plane, 0, size) for plane, size in enumerate(parts)]
        offsets = [sum(parts[:index]) for index in range(len(parts))]
        return [(0, offset, size) for offset, size in zip(offsets, parts)]

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.groups, self.block_size)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def slot_of_layer(self) -> list[tuple[int, int]]:
        """(group index, slot index) for each layer, in layer order."""
        where: dict[int, tuple[int, int]] = {}
        for group_index, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layer_indices):
                where[layer] = (group_index, slot)
        return [where[layer] for layer in range(self.num_layers)]

    def check_max_model_len_fits(self, max_model_len: int, max_step_tokens: int | None = None) -> None:
        check_max_model_len_fits([group.spec for group in self.groups], max_model_len, self.num_blocks, self.block_size,
                                 max_step_tokens)


def num_planes(groups: Sequence[KVCacheGroupSpec], block_size: int) -> int:
    counts = {len(g.spec.page_parts(block_size)) for g in groups}
    return counts.pop() if len(counts) == 1 else 1


def plane_bytes(groups: Sequence[KVCacheGroupSpec], block_size: int) -> int:
    if num_planes(groups, block_size) == 1:
        return max(g.spec.page_bytes(block_size) for g in groups)
    return max(max(g.spec.page_parts(block_size)) for g in groups)


def bytes_per_block(groups: Sequence[KVCacheGroupSpec], block_size: int) -> int:
    """What one block id costs: a page (the largest group's) in every slot."""
    planes = num_planes(groups, block_size)
    return max(len(g.layer_indices) for g in groups) * planes * plane_bytes(groups, block_size)


def blocks_per_request(group_specs: Sequence[KVCacheSpec], num_tokens: int, block_size: int,
                       max_step_tokens: int | None = None) -> int:
    """Blocks one request of `num_tokens` tokens holds at once, over its tables (one per group):
    all of them in full-attention groups, a window's worth (plus one step's) in window groups."""
    return sum(spec.max_num_blocks(num_tokens, block_size, max_step_tokens) for spec in group_specs)


def check_max_model_len_fits(group_specs: Sequence[KVCacheSpec], max_model_len: int, num_blocks: int,
                             block_size: int, max_step_tokens: int | None = None) -> None:
    """Start-up check: raises KVCacheTooSmallError (naming the largest max_model_len that fits)
    when one request of max_model_len tokens cannot get its blocks in every group at once, with
    steps of at most `max_step_tokens` tokens (the scheduler's budget; None: the whole request in
    one step). One such request fitting alone is what keeps the scheduler from stalling: the
    oldest running request can always get its blocks by preempting the others."""
    if blocks_per_request(group_specs, max_model_len, block_size, max_step_tokens) <= num_blocks:
        return
    low, high = 0, max_model_len  # the longest length that fits: blocks grow with length, bisect
    while low < high:
        middle = (low + high + 1) // 2
        if blocks_per_request(group_specs, middle, block_size, max_step_tokens) <= num_blocks:
            low = middle
        else:
            high = middle - 1
    raise KVCacheTooSmallError(max_model_len, low, num_blocks, block_size)


def group_layers(layer_specs: Sequence[KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Layers with equal specs, in groups of equal size where the kinds allow it.

    One kind: one group of every layer. Several: each kind is cut into groups of the smallest
    kind's layer count (Gemma 3's 5 window layers per global one: window layers in 5 groups as
    large as the global group), unless the largest kind is within 25% of it: then one group per
    kind, and the smaller kinds leave a few slots empty (cheaper than doubling the tables)."""
    if not layer_specs:
        raise ValueError("a model needs at least one attention layer")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for index, spec in enumerate(layer_specs):
        by_spec.setdefault(spec, []).append(index)
    sizes = [len(layers) for layers in by_spec.values()]
    group_size = max(sizes) if max(sizes) * 4 < min(sizes) * 5 else min(sizes)
    return tuple(
        KVCacheGroupSpec(tuple(layers[start:start + group_size]), spec)
        for spec, layers in by_spec.items()
        for start in range(0, len(layers), group_size)
    )


def plan_kv_cache_config(
    layer_specs: Sequence[KVCacheSpec],
    block_size: int,
    max_model_len: int,
    *,
    num_kv_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    max_step_tokens: int | None = None,
) -> KVCacheConfig:
    """The engine's start-up sizing: an explicit block count wins, else the memory budget
    (--kv-cache-memory, or the engine's default share of what the weights left) buys whole
    blocks. Fails with KVCacheTooSmallError when one max_model_len request would not fit (a
    window group counts what it holds at once: a window plus one step of `max_step_tokens`)."""
    if num_kv_blocks is None and kv_cache_memory is None:
        raise ValueError("give the KV cache a size: num_kv_blocks (--num-kv-blocks) or kv_cache_memory (--kv-cache-memory)")
    validate_block_size(block_size)
    groups = group_layers(layer_specs)
    if num_kv_blocks is None:
        if kv_cache_memory < 0:
            raise ValueError(f"memory must be >= 0 bytes, got {kv_cache_memory}")
        num_kv_blocks = kv_cache_memory // bytes_per_block(groups, block_size)
    check_max_model_len_fits([group.spec for group in groups], max_model_len, num_kv_blocks, block_size, max_step_tokens)
    return KVCacheConfig(num_kv_blocks, block_size, groups)
