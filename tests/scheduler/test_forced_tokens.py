"""Tokens the engine appends without sampling (jump-forward decoding): the request's next step
computes them with its last sampled token, through the KV cache, and sampling goes on after them."""

from __future__ import annotations

import pytest

from tests.scheduler.fake_model import reference_next_token
from tests.scheduler.harness import VOCAB_SIZE, Harness, make_config, make_request


def test_forced_tokens_are_computed_with_the_next_step_and_sampling_follows_them():
    h = Harness(num_blocks=32, config=make_config(max_model_len=128))
    request = make_request("r", 10, max_tokens=12, ignore_eos=True)
    h.add(request)
    h.step()  # the prompt, and the first token
    forced = [3, 4, 5, 6, 7, 8, 9, 10, 11]  # with the prompt, past the first block
    update = h.force("r", forced)
    assert update.new_token_ids == forced and not update.finished
    step = h.step()
    assert step.batch == [("r", 10)]  # the sampled token and the nine forced ones, in one step
    h.run()
    h.assert_idle()
    output = h.outputs["r"]
    assert output[1:10] == forced and len(output) == 12
    history = list(request.prompt_token_ids) + output[:10]
    assert output[10] == reference_next_token(history, VOCAB_SIZE)  # sampled after the forced text


def test_forced_tokens_end_the_request_at_max_tokens():
    h = Harness(num_blocks=32, config=make_config(max_model_len=128))
    h.add(make_request("r", 5, max_tokens=4, ignore_eos=True))
    h.step()
    update = h.force("r", [3, 4, 5, 6, 7])
    assert update.new_token_ids == [3, 4, 5] and update.finished
    h.run()  # the runner is told it ended
    h.assert_idle()


def test_only_a_running_request_takes_forced_tokens():
    h = Harness(num_blocks=32)
    h.add(make_request("r", 5, max_tokens=4))
    with pytest.raises(ValueError, match="not running"):
        h.scheduler.append_forced_tokens("r", [3])
