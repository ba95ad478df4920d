"""n > 1: completions of one prompt share its blocks; siblings fork from the leader."""

from __future__ import annotations

import pytest

from kvserve.scheduler import Request
from tests.scheduler.fake_model import reference_next_token
from tests.scheduler.harness import VOCAB_SIZE, Harness, make_config, make_request

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]  # 12 tokens: one full block of 8 and a partial one


def group(parent: str, prompt: list[int], n: int, arrival: float = 0.0, **params: object) -> list[Request]:
    return [
        make_request(f"{parent}#{i}", prompt, parent_id=parent, index=i, seed=i, arrival=arrival, **params)
        for i in range(n)
    ]


def reference_output(prompt: list[int], max_tokens: int, seed: int = 0) -> list[int]:
    """What completion `seed` (its index) of `prompt` must produce."""
    history = list(prompt)
    for _ in range(max_tokens):
        history.append(reference_next_token(history, VOCAB_SIZE, seed))
    return history[len(prompt):]


def test_siblings_share_prompt_blocks_and_copy_the_partial_block_on_write() -> None:
    h = Harness(num_blocks=32)
    h.add(*group("p", PROMPT, 3, max_tokens=4))
    first = h.step()
    assert first.batch == [("p#0", 12)]  # the prompt is computed once
    assert h.scheduler.num_running == 3 and h.scheduler.num_waiting == 0  # forked in that update
    leader_blocks = h.kv.block_ids("p#0")
    assert h.kv.block_ids("p#1") == leader_blocks == h.kv.block_ids("p#2")
    assert [h.kv.refcount(b) for b in leader_blocks] == [3, 3]
    assert h.kv.stats().blocks_used == 2

    second = h.step()
    # Each sibling recomputes the last prompt token (position 11) and samples its first token.
    assert second.batch == [("p#0", 1), ("p#1", 1), ("p#2", 1)]
    assert [(s.num_computed_tokens, s.token_ids) for s in second.inputs[1:]] == [(11, [8]), (11, [8])]
    # The partial block is shared three ways: the first two writers copy it, the last keeps it.
    copies = second.output.blocks_to_copy
    assert [source for source, _ in copies] == [leader_blocks[1], leader_blocks[1]]
    tables = [h.kv.block_ids(f"p#{i}") for i in range(3)]
    assert {t[0] for t in tables} == {leader_blocks[0]}  # the full block stays shared
    assert len({t[1] for t in tables}) == 3

    h.run()
    outputs = [h.outputs[f"p#{i}"] for i in range(3)]
    assert outputs == [reference_output(PROMPT, 4, seed=i) for i in range(3)]
    assert len({tuple(o) for o in outputs}) == 3  # distinct seeds diverge: sharing is checked
    assert h.runner.num_copies == 2
    h.assert_idle()


def test_block_aligned_prompt_forks_and_siblings_copy_the_last_full_block() -> None:
    prompt = PROMPT + [9, 7, 9, 3]  # 16 tokens: the leader's next token opens a fresh block
    h = Harness(num_blocks=32)
    h.add(*group("p", prompt, 2, max_tokens=3))
    h.step()
    second = h.step()
    assert second.batch == [("p#0", 1), ("p#1", 1)]
    assert len(second.output.blocks_to_copy) == 1
    h.run()
    assert [h.outputs["p#0"], h.outputs["p#1"]] == [reference_output(prompt, 3, seed=i) for i in range(2)]
    h.assert_idle()


def test_leader_finishing_on_its_first_token_still_shares_with_siblings() -> None:
    h = Harness(num_blocks=32)
    h.add(*group("p", PROMPT, 3, max_tokens=1))
    first = h.step()
    assert [u.finished for u in first.updates] == [True]
    assert h.scheduler.num_running == 2  # forked before the leader was freed
    assert h.step().batch == [("p#1", 1), ("p#2", 1)]
    assert h.outputs == {f"p#{i}": reference_output(PROMPT, 1, seed=i) for i in range(3)}
    h.assert_idle()


def test_siblings_fall_back_to_normal_admission_when_the_leader_is_preempted() -> None:
    # 3 blocks of 8. x (older) decodes into the last free block while the leader is still
    # computing its prompt in 4-token chunks; the leader is the newest and preempts itself.
    h = Harness(num_blocks=3, config=make_config(max_num_batched_tokens=9, max_model_len=24, long_prefill_token_threshold=4))
    h.add(make_request("x", 8, arrival=0, max_tokens=3))
    h.add(*group("p", PROMPT, 2, arrival=1, max_tokens=2))
    assert h.step().batch == [("x", 4), ("p#0", 4)]
    assert h.step().batch == [("x", 4), ("p#0", 4)]
    third = h.step()
    assert third.batch == [("x", 1)]
    assert third.output.preempted_request_ids == ["p#0"]
    h.run()
    sibling_steps = [s for r in h.steps for s in r.output.scheduled if s.request_id == "p#1"]
    # Admitted like any request: its first block is a prefix-cache hit, not a fork at 11 tokens.
    assert sibling_steps[0].num_computed_tokens == 8
    assert [h.outputs["p#0"], h.outputs["p#1"]] == [reference_output(PROMPT, 2, seed=i) for i in range(2)]
    h.assert_idle()


def test_siblings_beyond_max_num_seqs_wait_in_the_queue() -> None:
    h = Harness(num_blocks=32, config=make_config(max_num_seqs=2))
    h.add(*group("p", PROMPT, 3, max_tokens=2))
    h.step()
    assert h.scheduler.num_running == 2 and h.scheduler.num_waiting == 1
    h.run()
    assert all(h.outputs[f"p#{i}"] == reference_output(PROMPT, 2, seed=i) for i in range(3))
    h.assert_idle()


def test_one_token_prompt_siblings_are_admitted_normally() -> None:
    h = Harness(num_blocks=32)
    h.add(*group("p", [7], 2, max_tokens=2))
    h.run()
    assert [h.outputs["p#0"], h.outputs["p#1"]] == [reference_output([7], 2, seed=i) for i in range(2)]
    h.assert_idle()


def test_siblings_with_a_different_prompt_are_rejected() -> None:
    h = Harness(num_blocks=32)
    h.add(make_request("p#0", PROMPT, parent_id="p"))
    with pytest.raises(ValueError, match="share the prompt"):
        h.scheduler.add_request(make_request("p#1", PROMPT[:-1], parent_id="p", index=1))
    assert h.scheduler.num_waiting == 1
    h.run()
    h.assert_idle()
