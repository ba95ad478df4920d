"""Prefix caching: full blocks keyed by a hash of everything before them and their own tokens.

    root = H(salt)                         a per-tenant salt keeps tenants' caches apart
    key0 = H(root, tokens[0:16])
    key1 = H(key0, tokens[16:32])          chaining makes a key name the WHOLE prefix,
    key2 = H(key1, tokens[32:48])          not just one block's 16 tokens

A lookup walks the chain and stops at the first miss, so the longest cached prefix costs one
hash per matching block. SHA-256 keeps collisions out of reach even with untrusted prompts, and a
hit is still verified against the stored parent key and token ids before it is trusted.

This class only maps keys to block ids; reference counts and eviction order live in the
BlockAllocator, which calls `forget` when it evicts a cached block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = bytes
BlockHasher = Callable[[BlockHash, Sequence[int]], BlockHash]


def root_hash(salt: str | None) -> BlockHash:
    """The parent key of a request's first block. No salt and the empty salt differ."""
    material = b"kvserve-prefix\x00" if salt is None else b"kvserve-prefix\x01" + salt.encode("utf-8")
    return hashlib.sha256(material).digest()


def sha256_block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """H(parent key, token ids). The parent is a fixed 32 bytes, so the encoding is unambiguous."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(frozen=True)
class CachedBlock:
    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]


class PrefixCache:
    def __init__(self, block_size: int, hasher: BlockHasher = sha256_block_hash) -> None:
        self.block_size = block_size
        self._hasher = hasher
        self._by_hash: dict[BlockHash, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._by_block

    def hash_of(self, block_id: int) -> BlockHash:
        return self._by_block[block_id].block_hash

    def extend_hashes(self, hashes: list[BlockHash], token_ids: Sequence[int], root: BlockHash, num_full_blocks: int) -> None:
        """Append the chained keys of blocks len(hashes) .. num_full_blocks-1 to `hashes`
        (`root` is the request's `root_hash(salt)`). Callers keep `hashes` per request so each
        block is hashed once in its life."""
        size = self.block_size
        parent = hashes[-1] if hashes else root
        for index in range(len(hashes), num_full_blocks):
            parent = self._hasher(parent, token_ids[index * size : (index + 1) * size])
            hashes.append(parent)

    def lookup(self, token_ids: Sequence[int], hashes: list[BlockHash], root: BlockHash, max_blocks: int) -> list[int]:
        """Block ids of the longest cached, verified prefix of at most `max_blocks` full blocks.
        `hashes` holds the chained keys computed so far for these tokens (start with []): the
        lookup extends it as it walks, so several layer groups hash a prompt once."""
        found: list[int] = []
        for index in range(max_blocks):
            if index == len(hashes):
                self.extend_hashes(hashes, token_ids, root, index + 1)
            block_id = self.cached_block(index, token_ids, hashes, root)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def cached_block(self, index: int, token_ids: Sequence[int], hashes: list[BlockHash], root: BlockHash) -> int | None:
        """The verified cached block holding full block `index` of these tokens, or None.
        `hashes` must already hold its key (extend_hashes). The key chains the whole prefix, so
        a hit here means the same prefix, whether or not its earlier blocks are still cached
        (a sliding-window group looks up only its window's blocks)."""
        size = self.block_size
        entry = self._by_hash.get(hashes[index])
        parent = hashes[index - 1] if index else root
        if entry is None or entry.parent_hash != parent or entry.token_ids != tuple(token_ids[index * size:(index + 1) * size]):
            return None
        return entry.block_id

    def register(self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Make a full block findable. False (and nothing changes) when the block is already
        cached or another block already holds this key: two requests computed the same prefix
        at once, and the first one's block stays the shared copy."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks ({self.block_size} tokens) can be cached, got {len(token_ids)} tokens")
        if block_id in self._by_block or block_hash in self._by_hash:
            return False
        entry = CachedBlock(block_id, block_hash, parent_hash, tuple(token_ids))
        self._by_hash[block_hash] = entry
        self._by_block[block_id] = entry
        return True

    def forget(self, block_id: int) -> None:
        """Drop a block's entry (it is being evicted and will hold other tokens)."""
        entry = self._by_block.pop(block_id)
        del self._by_hash[entry.block_hash]
