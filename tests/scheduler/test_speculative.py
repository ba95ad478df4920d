"""Speculative decoding in the scheduler: drafts ride along with a decode, rejected ones cost
nothing but their slots (recomputed later), and every workload's output is exactly the output
without drafts, whatever the drafts were."""

from __future__ import annotations

import random

import pytest

from kvserve.scheduler import Request
from tests.scheduler.fake_model import reference_next_token
from tests.scheduler.harness import VOCAB_SIZE, Harness, make_config, make_request


def reference_output(prompt: list[int], num_tokens: int, seed: int = 0) -> list[int]:
    history, output = list(prompt), []
    for _ in range(num_tokens):
        token = reference_next_token(history, VOCAB_SIZE, seed)
        history.append(token)
        output.append(token)
    return output


def oracle(k: int):
    """Drafts that are always right: the next k tokens of the reference."""
    def drafts(request: Request) -> list[int]:
        return reference_output(request.all_token_ids, k, request.seed)
    return drafts


def wrong(k: int):
    def drafts(request: Request) -> list[int]:
        right = reference_output(request.all_token_ids, k, request.seed)
        return [(t + 1) % VOCAB_SIZE for t in right]
    return drafts


def mixed(k: int, seed: int = 0):
    rng = random.Random(seed)

    def drafts(request: Request) -> list[int]:
        right = reference_output(request.all_token_ids, k, request.seed)
        keep = rng.randint(0, k)
        return right[:keep] + [rng.randrange(VOCAB_SIZE) for _ in range(k - keep)]
    return drafts


@pytest.mark.parametrize("drafter", [oracle(4), wrong(3), mixed(5)], ids=["right", "wrong", "mixed"])
def test_any_drafts_give_the_output_without_drafts(drafter):
    h = Harness(num_blocks=64, config=make_config(max_model_len=64), drafter=drafter)
    requests = [make_request(f"r{i}", 6 + 3 * i, max_tokens=20, ignore_eos=True) for i in range(4)]
    h.add(*requests)
    h.run()
    h.assert_idle()
    for request in requests:
        assert h.outputs[request.request_id] == reference_output(request.prompt_token_ids, 20), request.request_id


def test_right_drafts_take_fewer_steps_and_wrong_ones_the_same_as_none():
    def steps(drafter) -> int:
        h = Harness(num_blocks=64, config=make_config(max_model_len=64), drafter=drafter)
        h.add(make_request("a", 8, max_tokens=20, ignore_eos=True))
        return len(h.run())

    plain, right, bad = steps(None), steps(oracle(4)), steps(wrong(4))
    assert plain == 20 and bad == plain  # the prefill samples the first token, 19 decodes the rest
    assert right == 1 + 4  # then each step keeps its 4 drafts + 1: 19 more tokens in 4 steps


def test_drafts_stay_inside_max_tokens_the_context_and_the_budget():
    h = Harness(num_blocks=64, config=make_config(max_model_len=20, max_num_batched_tokens=3), drafter=oracle(8))
    h.add(make_request("a", 10, max_tokens=6, ignore_eos=True))
    for record in h.run():
        assert record.output.num_scheduled_tokens <= 3
        for scheduled in record.output.scheduled:
            assert scheduled.seq_len <= 20
    assert len(h.outputs["a"]) == 6
    h2 = Harness(num_blocks=64, config=make_config(max_model_len=14), drafter=oracle(8))
    h2.add(make_request("b", 10, max_tokens=None, ignore_eos=True))
    h2.run()
    assert len(h2.outputs["b"]) == 4  # stopped by max_model_len, never written past it


def test_a_stop_token_among_kept_drafts_ends_the_request_there():
    prompt = [1, 2, 3, 4, 5]
    expected = reference_output(prompt, 12)
    stop = expected[2]
    h = Harness(num_blocks=64, config=make_config(max_model_len=64), drafter=oracle(6))
    h.add(make_request("a", prompt, max_tokens=12, ignore_eos=True, stop_token_ids=[stop]))
    h.run()
    assert h.outputs["a"] == expected[:expected.index(stop) + 1]
    h.assert_idle()


def test_drafts_never_cause_a_preemption_and_preemption_keeps_the_output():
    # 6 blocks of 8: three requests that need 3 blocks each at the end cannot all stay.
    h = Harness(num_blocks=6, config=make_config(max_model_len=24), drafter=mixed(6, seed=3))
    requests = [make_request(f"r{i}", 8, max_tokens=12, ignore_eos=True) for i in range(3)]
    h.add(*requests)
    records = h.run()
    h.assert_idle()
    for request in requests:
        assert h.outputs[request.request_id] == reference_output(request.prompt_token_ids, 12)
    assert any(r.output.preempted_request_ids for r in records)
    assert h.runner.num_drafts > 0 and 0 < h.runner.num_accepted < h.runner.num_drafts


def test_chunked_prefill_prefix_hits_and_siblings_with_drafts():
    h = Harness(num_blocks=64, config=make_config(max_model_len=64, max_num_batched_tokens=7), drafter=mixed(4, 1))
    shared = list(range(1, 17))
    requests = [make_request("a", shared + [5], max_tokens=10, ignore_eos=True),
                make_request("b", shared + [9, 9], max_tokens=10, ignore_eos=True)]
    h.add(*requests)
    h.run()
    h.assert_idle()
    for request in requests:
        assert h.outputs[request.request_id] == reference_output(request.prompt_token_ids, 10)
