"""A fake model for scheduler tests: no torch, deterministic, and it reads through the KV cache.

Each position's "KV" is a hash chained from the previous position's KV (read back from the
simulated cache through the block table) and the token at that position, so it depends on the
whole history, as a transformer's does. The sampled token is a hash of every KV slot of the
context, read through the block table. A scheduler or allocator bug (a wrong block table, a
missing copy-on-write, a prefix-cache hit on the wrong block, a slot never written) therefore
changes the output or fails an assertion, and the next token is a deterministic function of
the full token history, so a preempted request must produce exactly its unpreempted output.

Like the real runner it knows a request only through the step diffs (new requests once, then new
tokens and new blocks), so a diff that loses a token or a block shows up here too.

A sliding-window group's table is read only inside its window (the last w positions), as the
kernels read it: its entries before the window may be None (given back) or stale ids that another
request now writes. Sampling reads the full-attention group's whole context, or, in a model with
window groups only, the widest window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.scheduler import ModelRunnerOutput, SchedulerOutput

ROOT_STATE = 0x5EED


def kv_state(previous: int, token_id: int, position: int) -> int:
    return hash((previous, token_id, position))


def next_token(states: list[int], seed: int, vocab_size: int) -> int:
    # The request's seed stands in for its sampler: n > 1 siblings (distinct seeds) diverge, so a
    # block they wrongly share after the fork shows up in their outputs.
    return hash((seed, *states)) % vocab_size


def reference_next_token(history: list[int], vocab_size: int, seed: int = 0, window: int | None = None) -> int:
    """What the fake model samples after `history`, computed without any cache (`window`: the
    fake runner's sampling_window)."""
    states, state = [], ROOT_STATE
    for position, token_id in enumerate(history):
        state = kv_state(state, token_id, position)
        states.append(state)
    return next_token(states if window is None else states[-window:], seed, vocab_size)


@dataclass
class _RequestState:
    """What the fake runner holds of a request: built only from the step diffs, as the real one."""

    num_prompt_tokens: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class StepInput:
    """What the runner computed for one request in one step (its view, rebuilt from the diffs)."""

    request_id: str
    num_computed_tokens: int
    token_ids: list[int]
    samples: bool


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 32,
                 windows: Sequence[int | None] = (None,)) -> None:
        """`windows`: each layer group's sliding window (None: full attention); at least 2, as
        the chain reads the previous position."""
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.windows = list(windows)
        assert all(w is None or w >= 2 for w in self.windows)
        # What sampling reads: the whole context if a group keeps it, else the widest window.
        self.sampling_window = None if None in self.windows else max(self.windows)
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.num_copies = 0
        self.requests: dict[str, _RequestState] = {}
        self.last_inputs: list[StepInput] = []
        self.num_drafts = self.num_accepted = 0

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_req_ids:
            del self.requests[request_id]  # told once, of a request it holds
        for new in output.new_requests:
            assert new.request_id not in self.requests, f"{new.request_id} was sent as new twice"
            self.requests[new.request_id] = _RequestState(new.num_prompt_tokens, new.seed)
        for source, destination in output.blocks_to_copy:
            self.cache[destination] = list(self.cache[source])
            self.num_copies += 1
        request_ids, token_ids = [], []
        self.last_inputs = []
        for scheduled in output.scheduled:
            state = self.requests[scheduled.request_id]
            state.token_ids.extend(scheduled.new_token_ids)
            if scheduled.tables_replaced:
                state.tables = [list(table) for table in scheduled.new_block_ids]
            else:
                for table, new_blocks in zip(state.tables, scheduled.new_block_ids):
                    table.extend(new_blocks)
            start, end = scheduled.num_computed_tokens, scheduled.seq_len
            drafts = list(scheduled.spec_token_ids)
            known = end - len(drafts)  # the request's own tokens end here; drafts follow
            assert known <= len(state.token_ids), f"{scheduled.request_id}: tokens up to {known} were never sent"
            assert scheduled.samples == (known == len(state.token_ids))
            assert not drafts or scheduled.samples, "drafts only follow a decode"
            for table in state.tables:
                assert len(table) * self.block_size >= end, f"{scheduled.request_id}: its table is too short"
            inputs = state.token_ids[start:known] + drafts
            self.last_inputs.append(StepInput(scheduled.request_id, start, inputs[:known - start], scheduled.samples))
            for table in state.tables:  # every group's table must hold the same history
                kv = self._read(table, start - 1) if start else ROOT_STATE
                for offset, token_id in enumerate(inputs):
                    kv = kv_state(kv, token_id, start + offset)
                    self._write(table, start + offset, kv)
            if scheduled.samples:
                # One token per position from the request's last token on; keep the drafts that
                # equal them, and one more (as the real runner's verification does).
                kept = []
                for offset in range(len(drafts) + 1):
                    token = next_token(self._context(state.tables, known + offset), state.seed, self.vocab_size)
                    kept.append(token)
                    if offset == len(drafts) or drafts[offset] != token:
                        break
                self.num_drafts += len(drafts)
                self.num_accepted += len(kept) - 1
                request_ids.append(scheduled.request_id)
                token_ids.append(kept)
        return ModelRunnerOutput(request_ids, token_ids, [None] * len(request_ids))

    def _context(self, tables: list[list[int | None]], end: int) -> list[int]:
        """The KV states sampling reads for the token after position end - 1, checking that every
        group holds the same history inside what it keeps."""
        first = 0 if self.sampling_window is None else max(0, end - self.sampling_window)
        sampled = next(t for t, w in zip(tables, self.windows) if w == self.sampling_window)
        states = [self._read(sampled, p) for p in range(first, end)]
        for table, window in zip(tables, self.windows):
            start_read = first if window is None else max(first, end - window)
            assert [self._read(table, p) for p in range(start_read, end)] == states[start_read - first:]
        return states

    def _read(self, block_ids: list[int | None], position: int) -> int:
        block_id = block_ids[position // self.block_size]
        assert block_id is not None, f"position {position} was read from a block given back"
        value = self.cache[block_id][position % self.block_size]
        assert value is not None, f"position {position} was read before it was written"
        return value

    def _write(self, block_ids: list[int | None], position: int, state: int) -> None:
        self.cache[block_ids[position // self.block_size]][position % self.block_size] = state
