import pytest

from kvserve.paging import PrefixCache
from kvserve.paging.prefix_cache import root_hash, sha256_block_hash

SIZE = 8


def chain(cache: PrefixCache, tokens: list[int], salt: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    cache.extend_hashes(hashes, tokens, root_hash(salt), len(tokens) // SIZE)
    return hashes


def register_all(cache: PrefixCache, tokens: list[int], first_block_id: int = 0, salt: str | None = None) -> None:
    hashes = chain(cache, tokens, salt)
    for index, key in enumerate(hashes):
        parent = hashes[index - 1] if index else root_hash(salt)
        assert cache.register(first_block_id + index, key, parent, tokens[index * SIZE : (index + 1) * SIZE])


def test_a_key_names_the_whole_prefix_not_just_the_block():
    cache = PrefixCache(SIZE)
    same_block = list(range(SIZE))
    first = chain(cache, same_block + same_block)
    assert first[0] != first[1]  # equal tokens, different parents
    assert chain(cache, [99] * SIZE + same_block)[1] != first[1]
    assert chain(cache, same_block + same_block) == first  # deterministic


def test_salt_keeps_tenants_apart_and_none_differs_from_empty():
    assert len({root_hash(None), root_hash(""), root_hash("tenant-a"), root_hash("tenant-b")}) == 4
    cache = PrefixCache(SIZE)
    tokens = list(range(3 * SIZE))
    register_all(cache, tokens, salt="tenant-a")
    assert cache.lookup(tokens, [], root_hash("tenant-a"), 3) == [0, 1, 2]
    assert cache.lookup(tokens, [], root_hash("tenant-b"), 3) == []
    assert cache.lookup(tokens, [], root_hash(None), 3) == []


def test_lookup_returns_the_longest_prefix_and_memoises_the_keys():
    cache = PrefixCache(SIZE)
    tokens = list(range(4 * SIZE))
    register_all(cache, tokens[: 2 * SIZE], first_block_id=5)
    assert cache.lookup(tokens, [], root_hash(None), 4) == [5, 6]
    assert cache.lookup(tokens, [], root_hash(None), 1) == [5]
    diverging = tokens[:SIZE] + [0] * SIZE
    assert cache.lookup(diverging, [], root_hash(None), 2) == [5]
    hashes = []
    assert cache.lookup(tokens, hashes, root_hash(None), 4) == [5, 6]
    assert len(hashes) == 3  # hashed up to the first miss, ready for the next group's lookup
    assert hashes == chain(cache, tokens[: 3 * SIZE])
    assert cache.lookup(tokens, hashes, root_hash(None), 4) == [5, 6] and len(hashes) == 3


def test_a_hit_is_verified_against_the_stored_tokens():
    # A hasher that collides on everything: only the verification can tell blocks apart.
    cache = PrefixCache(SIZE, hasher=lambda parent, tokens: b"x" * 32)
    stored = list(range(SIZE))
    cache.register(3, b"x" * 32, root_hash(None), stored)
    assert cache.lookup([7] * SIZE + [0], [], root_hash(None), 1) == []
    assert cache.lookup(stored + [0], [], root_hash(None), 1) == [3]
    assert cache.lookup(stored + [0], [], root_hash("other"), 1) == []  # parent key differs


def test_register_keeps_the_first_block_for_a_key_and_forget_removes_it():
    cache = PrefixCache(SIZE)
    tokens = list(range(SIZE))
    key = sha256_block_hash(root_hash(None), tokens)
    assert cache.register(1, key, root_hash(None), tokens)
    assert not cache.register(2, key, root_hash(None), tokens)  # duplicate content
    assert not cache.register(1, key, root_hash(None), tokens)  # already cached
    assert cache.is_cached(1) and not cache.is_cached(2) and cache.hash_of(1) == key
    cache.forget(1)
    assert len(cache) == 0 and cache.lookup(tokens + [0], [], root_hash(None), 1) == []
    assert cache.register(2, key, root_hash(None), tokens)


def test_only_full_blocks_are_cached():
    cache = PrefixCache(SIZE)
    with pytest.raises(ValueError, match="only full blocks"):
        cache.register(0, b"k" * 32, root_hash(None), [1, 2, 3])
