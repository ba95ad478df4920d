"""Batch composition per step: decodes first, then waiting prompts in policy order, chunked to
the token budget, never more than max_num_seqs requests."""

from __future__ import annotations

import pytest

from kvserve.scheduler import RequestStatus
from tests.scheduler.fake_model import reference_next_token
from tests.scheduler.harness import VOCAB_SIZE, Harness, make_config, make_request


def test_exact_batch_composition_per_step() -> None:
    h = Harness(num_blocks=64, config=make_config(max_num_batched_tokens=20, max_num_seqs=3))
    h.add(
        make_request("a", 12, max_tokens=3),
        make_request("b", 10, max_tokens=2),
        make_request("c", 5, max_tokens=2),
        make_request("d", 3, max_tokens=1),
    )
    batches = [record.batch for record in h.run()]
    assert batches == [
        [("a", 12), ("b", 8)],  # b's prompt is cut to the 8 tokens left of the budget
        [("a", 1), ("b", 2), ("c", 5)],  # a decodes, b finishes its prompt, c joins: 3 seqs
        [("a", 1), ("b", 1), ("c", 1)],  # max_num_seqs = 3 keeps d waiting
        [("d", 3)],  # a, b, c finished in the previous update
    ]
    assert {rid: len(out) for rid, out in h.outputs.items()} == {"a": 3, "b": 2, "c": 2, "d": 1}
    h.assert_idle()


def test_decodes_come_before_new_prompts_and_budget_is_respected() -> None:
    h = Harness(num_blocks=64, config=make_config(max_num_batched_tokens=6, max_num_seqs=8))
    h.add(make_request("a", 4, max_tokens=5), make_request("b", 4, max_tokens=5))
    assert h.step().batch == [("a", 4), ("b", 2)]
    h.add(make_request("c", 9, max_tokens=2))
    assert h.step().batch == [("a", 1), ("b", 2), ("c", 3)]
    assert h.step().batch == [("a", 1), ("b", 1), ("c", 4)]
    assert h.step().batch == [("a", 1), ("b", 1), ("c", 2)]
    for record in h.run():
        assert record.output.num_scheduled_tokens <= 6
    h.assert_idle()


def test_chunk_boundaries_and_sampling_only_at_prompt_end() -> None:
    h = Harness(num_blocks=64, config=make_config(max_num_batched_tokens=8))
    request = make_request("a", 30, max_tokens=3)
    prompt = list(request.prompt_token_ids)
    h.add(request)
    records = h.run()
    chunks = [(s.num_computed_tokens, s.token_ids, s.samples) for r in records for s in r.inputs]
    out = h.outputs["a"]
    assert chunks == [
        (0, prompt[0:8], False),
        (8, prompt[8:16], False),
        (16, prompt[16:24], False),
        (24, prompt[24:30], True),
        (30, [out[0]], True),
        (31, [out[1]], True),
    ]
    # A chunk that samples nothing reports an update with no tokens.
    assert [u.new_token_ids for u in records[0].updates] == [[]]
    assert h.finished["a"].num_computed_tokens == 32
    h.assert_idle()


def test_long_prefill_token_threshold_caps_each_prompt_chunk() -> None:
    config = make_config(max_num_batched_tokens=20, long_prefill_token_threshold=5)
    h = Harness(num_blocks=64, config=config)
    h.add(make_request("a", 12, max_tokens=1), make_request("b", 7, max_tokens=1), make_request("c", 3, max_tokens=1))
    assert h.step().batch == [("a", 5), ("b", 5), ("c", 3)]
    assert h.step().batch == [("a", 5), ("b", 2)]
    assert h.step().batch == [("a", 2)]
    h.run()
    h.assert_idle()


def test_fcfs_head_of_line_is_not_overtaken_when_its_blocks_are_short() -> None:
    # 4 blocks of 8: a holds 2 (3 once it decodes), b needs 3 and cannot fit; c needs 1 and
    # could, but must not jump b.
    h = Harness(num_blocks=4, config=make_config(max_num_batched_tokens=64, max_model_len=32))
    h.add(make_request("a", 16, max_tokens=3), make_request("b", 24, max_tokens=1), make_request("c", 2, max_tokens=1))
    assert h.step().batch == [("a", 16)]
    assert h.step().batch == [("a", 1)]
    assert h.step().batch == [("a", 1)]
    assert h.step().batch == [("b", 24), ("c", 2)]  # a finished and freed its 3 blocks
    h.assert_idle()


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    h = Harness(num_blocks=64, config=make_config(max_num_seqs=1, policy="priority"))
    h.add(
        make_request("late-low", 3, arrival=3.0, priority=5, max_tokens=1),
        make_request("early-low", 3, arrival=1.0, priority=5, max_tokens=1),
        make_request("high", 3, arrival=2.0, priority=0, max_tokens=1),
    )
    order = [record.batch[0][0] for record in h.run()]
    assert order == ["high", "early-low", "late-low"]
    h.assert_idle()


def test_fcfs_ignores_priority() -> None:
    h = Harness(num_blocks=64, config=make_config(max_num_seqs=1))
    h.add(make_request("first", 3, arrival=1.0, priority=9, max_tokens=1),
          make_request("second", 3, arrival=2.0, priority=0, max_tokens=1))
    assert [record.batch[0][0] for record in h.run()] == ["first", "second"]
    h.assert_idle()


def test_outputs_follow_the_fake_model() -> None:
    h = Harness(num_blocks=64)
    request = make_request("a", 11, max_tokens=6)
    history = list(request.prompt_token_ids)
    h.add(request)
    h.run()
    for token in h.outputs["a"]:
        assert token == reference_next_token(history, VOCAB_SIZE)
        history.append(token)
    assert request.status is RequestStatus.FINISHED
    h.assert_idle()


def test_add_request_rejects_bad_requests() -> None:
    h = Harness(num_blocks=64, config=make_config(max_model_len=16))
    with pytest.raises(ValueError, match="empty prompt"):
        h.add(make_request("empty", []))
    with pytest.raises(ValueError, match="max_model_len is 16"):
        h.add(make_request("long", 17))
    h.add(make_request("ok", 16))
    with pytest.raises(ValueError, match="already scheduled"):
        h.scheduler.add_request(make_request("ok", 3))
    h.run()
    assert h.finished["ok"].finish_reason.value == "length"
    h.assert_idle()
