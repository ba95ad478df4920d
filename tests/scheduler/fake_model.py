"""A fake model for scheduler tests: no torch, deterministic, and it reads through the KV cache.

Each position's "KV" is a hash chained from the previous position's KV (read back from the
simulated cache through the block table) and the token at that position, so it depends on the
whole history, as a transformer's does. The sampled token is a hash of every KV slot of the
context, read through the block table. A scheduler or allocator bug (a wrong block table, a
missing copy-on-write, a prefix-cache hit on the wrong block, a slot never written) therefore
changes the output or fails an assertion, and the next token is a deterministic function of
the full token history, so a preempted request must produce exactly its unpreempted output.
"""

from __future__ import annotations

from kvserve.scheduler import ModelRunnerOutput, SchedulerOutput

ROOT_STATE = 0x5EED


def kv_state(previous: int, token_id: int, position: int) -> int:
    return hash((previous, token_id, position))


def next_token(states: list[int], seed: int, vocab_size: int) -> int:
    # The request's seed stands in for its sampler: n > 1 siblings (distinct seeds) diverge, so a
    # block they wrongly share after the fork shows up in their outputs.
    return hash((seed, *states)) % vocab_size


def reference_next_token(history: list[int], vocab_size: int, seed: int = 0) -> int:
    """What the fake model samples after `history`, computed without any cache."""
    states, state = [], ROOT_STATE
    for position, token_id in enumerate(history):
        state = kv_state(state, token_id, position)
        states.append(state)
    return next_token(states, seed, vocab_size)


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 32) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.num_copies = 0

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for source, destination in output.blocks_to_copy:
            self.cache[destination] = list(self.cache[source])
            self.num_copies += 1
        request_ids, token_ids = [], []
        for scheduled in output.scheduled:
            start = scheduled.num_computed_tokens
            state = self._read(scheduled.block_ids, start - 1) if start else ROOT_STATE
            for offset, token_id in enumerate(scheduled.token_ids):
                state = kv_state(state, token_id, start + offset)
                self._write(scheduled.block_ids, start + offset, state)
            if scheduled.samples:
                states = [self._read(scheduled.block_ids, p) for p in range(scheduled.seq_len)]
                request_ids.append(scheduled.request_id)
                token_ids.append(next_token(states, scheduled.seed, self.vocab_size))
        return ModelRunnerOutput(request_ids, token_ids, [None] * len(request_ids))

    def _read(self, block_ids: list[int], position: int) -> int:
        value = self.cache[block_ids[position // self.block_size]][position % self.block_size]
        assert value is not None, f"position {position} was read before it was written"
        return value

    def _write(self, block_ids: list[int], position: int, state: int) -> None:
        self.cache[block_ids[position // self.block_size]][position % self.block_size] = state
