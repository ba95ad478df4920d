"""Preemption: the newest running request yields its blocks, goes to the front of the waiting
queue, and recomputes prompt + output later with the same result as an unpreempted run."""

from __future__ import annotations

import pytest

from kvserve.scheduler import RequestStatus
from tests.scheduler.harness import Harness, make_config, make_request

BIG = make_config(max_num_batched_tokens=256, max_model_len=32)


def test_newest_running_request_is_preempted_for_an_older_one() -> None:
    # Three 8-token prompts take one block each; the fourth block goes to a's first decode.
    h = Harness(num_blocks=4, config=BIG)
    h.add(*(make_request(rid, 8, arrival=i, max_tokens=4) for i, rid in enumerate("abc")))
    assert h.step().batch == [("a", 8), ("b", 8), ("c", 8)]
    h.add(make_request("d", 1, arrival=10, max_tokens=1))
    record = h.step()
    # b needs a block: c, the newest, is preempted (not b); no new prompt is admitted this step.
    assert record.batch == [("a", 1), ("b", 1)]
    assert record.output.preempted_request_ids == ["c"]
    assert h.scheduler.num_preemptions_total == 1
    assert h.step().batch == [("a", 1), ("b", 1)]  # c (9 tokens, 2 blocks) waits; d may not jump it
    assert h.step().batch == [("a", 1), ("b", 1)]
    # a and b finished: c comes back first (front of the queue), recomputing prompt + 1 output.
    record = h.step()
    assert record.batch == [("c", 9), ("d", 1)]
    assert record.output.scheduled[0].num_computed_tokens == 0
    h.run()
    assert h.finished["c"].num_preemptions == 1
    assert h.finished["c"].status is RequestStatus.FINISHED
    h.assert_idle()


def test_request_that_is_itself_the_newest_preempts_itself() -> None:
    h = Harness(num_blocks=3, config=make_config(max_num_batched_tokens=256, max_model_len=24))
    h.add(make_request("a", 8, arrival=0, max_tokens=3), make_request("b", 8, arrival=1, max_tokens=3))
    h.step()
    record = h.step()
    assert record.batch == [("a", 1)]
    assert record.output.preempted_request_ids == ["b"]
    assert h.finished.get("b") is None
    h.run()
    assert h.finished["b"].num_preemptions >= 1
    h.assert_idle()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_several_preemptions_in_one_step_requeue_oldest_first(prefix_caching: bool) -> None:
    h = Harness(num_blocks=5, config=BIG, enable_prefix_caching=prefix_caching)
    h.add(*(make_request(rid, 8, arrival=i, max_tokens=2) for i, rid in enumerate("abcd")))
    assert h.step().batch == [("a", 8), ("b", 8), ("c", 8), ("d", 8)]
    record = h.step()
    # a takes the free block; b preempts d (newest); c is then the newest and preempts itself.
    assert record.batch == [("a", 1), ("b", 1)]
    assert record.output.preempted_request_ids == ["d", "c"]
    # a and b are done; c is back before d, in arrival order, each recomputing prompt + 1 output.
    # With prefix caching c's full prompt block is still cached (d's was evicted for b's block).
    expected_c = 1 if prefix_caching else 9
    assert h.step().batch == [("c", expected_c), ("d", 9)]
    h.run()
    h.assert_idle()


def test_preempted_outputs_equal_unpreempted_outputs() -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        h = Harness(num_blocks=num_blocks, config=make_config(max_num_batched_tokens=40, max_model_len=64))
        h.add(*(make_request(f"r{i}", 5 + 7 * i % 23, arrival=i, max_tokens=12 + i % 9) for i in range(10)))
        h.run()
        h.assert_idle()
        return h.outputs, h.scheduler.num_preemptions_total

    reference, no_preemptions = run(num_blocks=200)
    squeezed, preemptions = run(num_blocks=8)
    assert no_preemptions == 0 and preemptions > 0
    assert squeezed == reference


def test_preemption_with_chunked_prompts_resumes_correctly() -> None:
    config = make_config(max_num_batched_tokens=10, max_model_len=64, long_prefill_token_threshold=6)

    def run(num_blocks: int) -> Harness:
        h = Harness(num_blocks=num_blocks, config=config)
        h.add(*(make_request(f"r{i}", 30 - 4 * i, arrival=i, max_tokens=10) for i in range(5)))
        h.run()
        h.assert_idle()
        return h

    squeezed = run(num_blocks=9)
    assert squeezed.scheduler.num_preemptions_total > 0
    assert squeezed.outputs == run(num_blocks=100).outputs
