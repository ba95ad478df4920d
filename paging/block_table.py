"""One request's page table: logical block i -> physical block id.

A token at position p lives in block `block_ids[p // block_size]`, row `p % block_size` (the
engine turns positions into cache slots for a whole step at once: engine/attention_metadata.py).

    positions   0 ........ 15 | 16 ....... 31 | 32 .. 36
    logical     block 0       | block 1       | block 2  (rows 5..15 unused: the only waste)
    physical    block_ids[0]  | block_ids[1]  | block_ids[2]

A sliding-window layer group gives back the blocks that fell wholly out of its window: their
entries become None (no block), so that logical block i still holds positions
i * block_size .. and the table keeps its length. Only a prefix of the table is ever given back.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.paging.block_allocator import validate_block_size


class BlockTable:
    """Block ids plus how many positions hold tokens. It owns no references: whoever appends a
    block id (the KVCacheManager) holds the block's reference for it."""

    def __init__(self, block_size: int = 16, block_ids: Iterable[int | None] = (), num_tokens: int = 0) -> None:
        validate_block_size(block_size)
        self.block_size = block_size
        self._block_ids: list[int | None] = list(block_ids)
        if not 0 <= num_tokens <= self.capacity:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(self._block_ids)} blocks of {block_size}")
        self.num_tokens = num_tokens

    def __len__(self) -> int:
        return len(self._block_ids)

    @property
    def block_ids(self) -> list[int | None]:
        """A copy: callers may keep it across steps while the table grows. None: a block given
        back (outside a sliding window)."""
        return list(self._block_ids)

    def __getitem__(self, index: int) -> int | None:
        return self._block_ids[index]

    @property
    def capacity(self) -> int:
        """Positions the blocks can hold."""
        return len(self._block_ids) * self.block_size

    @property
    def num_unused_slots(self) -> int:
        """Allocated slots holding no token: at most block_size - 1 when the table is tight."""
        return self.capacity - self.num_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` positions occupy."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, num_more_tokens: int) -> int:
        """Blocks to append before `num_more_tokens` more tokens fit."""
        if num_more_tokens < 0:
            raise ValueError(f"num_more_tokens must be >= 0, got {num_more_tokens}")
        return max(0, self.num_blocks_for(self.num_tokens + num_more_tokens) - len(self._block_ids))

    def append_block(self, block_id: int | None) -> None:
        self._block_ids.append(block_id)

    def drop_block(self, index: int) -> int:
        """Give back logical block `index` (its entry becomes None); returns its id, whose
        reference the caller releases."""
        block_id = self._block_ids[index]
        if block_id is None:
            raise ValueError(f"logical block {index} was already given back")
        self._block_ids[index] = None
        return block_id

    def replace_block(self, index: int, block_id: int) -> int:
        """Put `block_id` at logical `index` (copy-on-write); returns the block it replaced."""
        old = self._block_ids[index]
        self._block_ids[index] = block_id
        return old

    def append_tokens(self, num_tokens: int) -> None:
        """Advance the filled length; the blocks must already be there."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self.num_tokens + num_tokens > self.capacity:
            raise ValueError(
                f"{self.num_tokens + num_tokens} tokens need {self.num_blocks_for(self.num_tokens + num_tokens)} "
                f"blocks but the table has {len(self._block_ids)}: append blocks first (num_new_blocks_needed)"
            )
        self.num_tokens += num_tokens
