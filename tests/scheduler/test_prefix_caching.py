"""Prefix caching: full blocks already computed are reused and reported as cached tokens."""

from __future__ import annotations

from tests.scheduler.harness import Harness, make_config, make_request

SHARED = list(range(1, 21))  # 20 tokens: two full blocks of 8, then 4 more


def test_second_request_with_shared_prefix_skips_cached_blocks() -> None:
    h = Harness(num_blocks=32)
    h.add(make_request("first", SHARED + [7, 7], max_tokens=2))
    h.run()
    assert h.finished["first"].num_cached_tokens == 0
    h.add(make_request("second", SHARED + [9], max_tokens=2))
    record = h.step()
    # The two full blocks of the shared prefix are hits; only tokens 16..20 are computed.
    assert record.batch == [("second", 5)]
    assert record.output.scheduled[0].num_computed_tokens == 16
    h.run()
    second = h.finished["second"]
    assert second.num_cached_tokens == 16
    assert h.kv.stats().prefix_cache_hits >= 16
    h.assert_idle()


def test_cached_blocks_give_the_same_output_as_computing_them() -> None:
    def run(prefix_caching: bool) -> Harness:
        h = Harness(num_blocks=32, enable_prefix_caching=prefix_caching)
        for i in range(4):
            h.add(make_request(f"r{i}", SHARED + [i] * (i + 1), arrival=i, max_tokens=6))
            h.step()
        h.run()
        h.assert_idle()
        return h

    cached, plain = run(True), run(False)
    assert cached.outputs == plain.outputs
    assert [cached.finished[f"r{i}"].num_cached_tokens for i in range(4)] == [0, 16, 16, 16]
    assert [plain.finished[f"r{i}"].num_cached_tokens for i in range(4)] == [0, 0, 0, 0]


def test_identical_prompt_keeps_last_token_to_compute() -> None:
    h = Harness(num_blocks=32)
    h.add(make_request("a", SHARED[:16], max_tokens=1))
    h.run()
    h.add(make_request("b", SHARED[:16], max_tokens=1))
    record = h.step()
    # Both blocks are cached, but the last one must be recomputed to sample: 8 hit, 8 computed.
    assert record.batch == [("b", 8)]
    assert h.finished["b"].num_cached_tokens == 8
    assert h.outputs["a"] == h.outputs["b"]
    h.assert_idle()


def test_cache_salt_isolates_prefixes() -> None:
    h = Harness(num_blocks=32)
    first = make_request("a", SHARED, max_tokens=1)
    first.cache_salt = "tenant-1"
    h.add(first)
    h.run()
    other = make_request("b", SHARED, max_tokens=1)
    other.cache_salt = "tenant-2"
    h.add(other)
    assert h.step().batch == [("b", 20)]
    assert h.finished["b"].num_cached_tokens == 0
    h.assert_idle()


def test_preempted_request_reuses_its_own_cached_blocks() -> None:
    # b is preempted; its two full prompt blocks stay cached. a's decodes later evict one of them,
    # the tail first (blocks are freed last-first), so b's first block is a hit when it returns.
    h = Harness(num_blocks=5, config=make_config(max_model_len=40))
    h.add(make_request("a", 16, arrival=0, max_tokens=10), make_request("b", 17, arrival=1, max_tokens=3))
    assert h.step().batch == [("a", 16), ("b", 17)]
    record = h.step()
    assert record.output.preempted_request_ids == ["b"]
    records = h.run()
    readmission = next(s for r in records for s in r.output.scheduled if s.request_id == "b")
    assert readmission.num_computed_tokens == 8
    assert h.finished["b"].num_cached_tokens == 0  # reported for its first admission only
    h.assert_idle()
