"""Random allocate / append / fork / prefix-hit / free / evict sequences against KVCacheManager.

Besides the bookkeeping invariants, the machine simulates the KV data itself: every write puts
the token id into its (block, row), copy-on-write pairs copy rows, and after every operation each
request must read back exactly its own tokens through its block table. That catches aliasing (two
requests writing one block), wrong prefix hits and lost copies, not just counting errors.
"""

from collections import Counter, defaultdict
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.paging import KVCacheManager

NUM_BLOCKS = 12
BLOCK_SIZE = 8
# Shared prefixes make prefix hits (and evictions of cached blocks) common.
PREFIXES = [[], [1] * 8, [1] * 8 + [2] * 8, [1] * 8 + [2] * 5, [3] * 20, [4] * 16 + [5] * 8]


@dataclass
class ShadowRequest:
    tokens: list[int]
    num_computed: int
    salt: str | None


class KVCacheMachine(RuleBasedStateMachine):
    enable_prefix_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=self.enable_prefix_caching)
        self.requests: dict[str, ShadowRequest] = {}
        self.kv: defaultdict[int, list[int | None]] = defaultdict(lambda: [None] * BLOCK_SIZE)
        self.next_id = 0

    def _write(self, request_id: str, table: list[int], start: int, end: int) -> None:
        for source, destination in self.manager.take_blocks_to_copy():
            self.kv[destination] = list(self.kv[source])
        request = self.requests[request_id]
        for position in range(start, end):
            self.kv[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = request.tokens[position]
        request.num_computed = end

    def _blocks_needed(self, request_id: str, start: int, end: int) -> int:
        table = self.manager.block_ids(request_id)
        missing = max(0, -(-end // BLOCK_SIZE) - len(table))
        write_range = range(start // BLOCK_SIZE, min(len(table), -(-end // BLOCK_SIZE)))
        # Copy-on-write for blocks others hold, and for cached blocks (their tokens are promised).
        return missing + sum(1 for index in write_range if self.manager.refcount(table[index]) > 1 or self.manager.is_cached(table[index]))

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 2), max_size=20),
        salt=st.sampled_from([None, None, "tenant"]),
        use_prefix_cache=st.booleans(),
        chunk=st.integers(1, 40),
    )
    def admit(self, prefix: list[int], suffix: list[int], salt: str | None, use_prefix_cache: bool, chunk: int) -> None:
        prompt = prefix + suffix
        if not prompt:
            return
        (blocks,), num_cached = self.manager.get_computed_blocks(prompt, salt) if use_prefix_cache else (((),), 0)
        blocks = list(blocks)
        assert num_cached == len(blocks) * BLOCK_SIZE < len(prompt)
        for index, block_id in enumerate(blocks):  # a hit must hold exactly these tokens
            assert self.kv[block_id] == prompt[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
        num_new = min(chunk, len(prompt) - num_cached)
        request_id = f"r{self.next_id}"
        self.next_id += 1
        before = self.manager.stats()
        new = self.manager.allocate_slots(request_id, prompt, num_cached, num_new, (tuple(blocks),), salt)
        table = None if new is None else self.manager.block_ids(request_id)
        if new is not None:
            assert new == (tuple(table),)  # a first allocation reports the whole table
        if table is None:
            revived = sum(1 for block_id in blocks if self.manager.refcount(block_id) == 0)
            needed = -(-(num_cached + num_new) // BLOCK_SIZE) - len(blocks)
            assert needed > self.manager.num_free_blocks - revived
            assert self.manager.stats() == before and self.manager.block_ids(request_id) == []
            return
        assert table[: len(blocks)] == blocks
        self.requests[request_id] = ShadowRequest(prompt, num_cached, salt)
        self._write(request_id, table, num_cached, num_cached + num_new)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), new_token=st.integers(0, 2), chunk=st.integers(1, 24))
    def step(self, data: st.DataObject, new_token: int, chunk: int) -> None:
        """One scheduler step for a request: the next prompt chunk, or one decoded token."""
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests[request_id]
        if request.num_computed == len(request.tokens):
            request.tokens.append(new_token)
        start = request.num_computed
        end = min(len(request.tokens), start + chunk)
        table_before, stats_before = self.manager.block_ids(request_id), self.manager.stats()
        needed = self._blocks_needed(request_id, start, end)
        new = self.manager.allocate_slots(request_id, request.tokens, start, end - start)
        table = None if new is None else self.manager.block_ids(request_id)
        if table is None:
            assert needed > self.manager.num_free_blocks
            assert self.manager.block_ids(request_id) == table_before and self.manager.stats() == stats_before
            return
        assert needed <= stats_before.blocks_free + stats_before.blocks_cached
        self._write(request_id, table, start, end)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = data.draw(st.sampled_from(sorted(self.requests)))
        parent = self.requests[parent_id]
        num_tokens = data.draw(st.integers(0, parent.num_computed))
        child_id = f"r{self.next_id}"
        self.next_id += 1
        self.manager.fork(parent_id, child_id, num_tokens)
        self.requests[child_id] = ShadowRequest(parent.tokens[:num_tokens], num_tokens, parent.salt)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        self.manager.free(request_id)
        del self.requests[request_id]
        assert self.manager.block_ids(request_id) == []

    @invariant()
    def blocks_add_up_and_references_match_owners(self) -> None:
        stats = self.manager.stats()
        assert stats.blocks_used + stats.blocks_cached + stats.blocks_free == stats.blocks_total == NUM_BLOCKS
        assert self.manager.num_free_blocks == stats.blocks_cached + stats.blocks_free
        owners: Counter[int] = Counter()
        for request_id in self.requests:
            table = self.manager.block_ids(request_id)
            assert len(set(table)) == len(table), "a table holds a block twice"
            owners.update(table)
        for block_id in range(NUM_BLOCKS):
            # A block in two tables is shared by reference count, never owned twice by accident.
            assert self.manager.refcount(block_id) == owners[block_id] >= 0
        assert stats.blocks_used == len(owners)
        for block_id in self.manager.eviction_order():
            assert self.manager.refcount(block_id) == 0

    @invariant()
    def every_request_reads_back_its_own_tokens_with_little_waste(self) -> None:
        stats = self.manager.stats()
        assert stats.tokens_stored <= stats.slots_allocated
        for request_id, request in self.requests.items():
            table = self.manager.block_ids(request_id)
            assert len(table) * BLOCK_SIZE - request.num_computed <= BLOCK_SIZE - 1
            stored = [self.kv[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] for position in range(request.num_computed)]
            assert stored == request.tokens[: request.num_computed]

    def teardown(self) -> None:
        for request_id in list(self.requests):
            self.manager.free(request_id)
        stats = self.manager.stats()
        assert (stats.blocks_used, stats.tokens_stored, self.manager.num_free_blocks) == (0, 0, NUM_BLOCKS)
        assert all(self.manager.refcount(block_id) == 0 for block_id in range(NUM_BLOCKS))


class KVCacheMachineWithoutPrefixCaching(KVCacheMachine):
    enable_prefix_caching = False


KVCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
KVCacheMachineWithoutPrefixCaching.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestKVCacheManagerProperties = KVCacheMachine.TestCase
TestKVCacheManagerPropertiesWithoutPrefixCaching = KVCacheMachineWithoutPrefixCaching.TestCase
