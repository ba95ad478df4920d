"""The engine's one admission check: every refusal is an AdmissionError naming the engine's field at fault
(never an API's spelling or error code: those are the server's)."""

from __future__ import annotations

import pytest

from kvserve.engine.admission import AdmissionCheck, AdmissionError, PromptTooLongError
from kvserve.scheduler import SamplingParams, SchedulerConfig

FCFS = AdmissionCheck(SchedulerConfig(max_model_len=16), vocab_size=100)


def refusal(check: AdmissionCheck, prompt: list[int], params: SamplingParams = SamplingParams(max_tokens=4),
            **kwargs: object) -> AdmissionError:
    with pytest.raises(AdmissionError) as refused:
        check.check(prompt, params, **kwargs)  # type: ignore[arg-type]
    return refused.value


def test_a_request_that_fits_is_admitted() -> None:
    FCFS.check([1, 2, 3], SamplingParams(max_tokens=13, logit_bias={99: 1.0}, stop_token_ids=(0,)))
    FCFS.check(list(range(15)), SamplingParams(max_tokens=None))  # None: up to max_model_len


def test_empty_prompt() -> None:
    assert refusal(FCFS, []).field == "prompt"


@pytest.mark.parametrize(("num_prompt", "max_tokens", "param"), [(16, None, "prompt"), (20, 1, "prompt"),
                                                                 (10, 7, "max_tokens")])
def test_context_length_names_what_to_change(num_prompt: int, max_tokens: int | None, param: str) -> None:
    error = refusal(FCFS, [1] * num_prompt, SamplingParams(max_tokens=max_tokens))
    assert isinstance(error, PromptTooLongError)
    assert (error.field, error.max_model_len) == (param, 16)
    assert "maximum context length is 16 tokens" in str(error)
    if param == "max_tokens":  # the server names the budget as its API does
        assert str(error).endswith("reduce the prompt or max_tokens.")
        assert error.describe("max_output_tokens").endswith("reduce the prompt or max_output_tokens.")
    assert not hasattr(error, "code")


@pytest.mark.parametrize(("prompt", "params", "param"), [
    ([1, 100], SamplingParams(max_tokens=1), "prompt"),
    ([-1], SamplingParams(max_tokens=1), "prompt"),
    ([1], SamplingParams(max_tokens=1, logit_bias={100: 1.0}), "logit_bias"),
    ([1], SamplingParams(max_tokens=1, stop_token_ids=(5, 120)), "stop_token_ids"),
])
def test_token_ids_must_be_rows_of_the_models_vocabulary(prompt: list[int], params: SamplingParams,
                                                         param: str) -> None:
    error = refusal(FCFS, prompt, params)
    assert error.field == param and "outside the vocabulary [0, 100)" in str(error)


def test_priority_needs_priority_scheduling() -> None:
    assert refusal(FCFS, [1], priority=3).field == "priority"
    FCFS.check([1], SamplingParams(max_tokens=1), priority=0)
    AdmissionCheck(SchedulerConfig(max_model_len=16, policy="priority"), 100).check([1], SamplingParams(max_tokens=1), priority=-5)


def test_cache_salt_must_not_be_empty() -> None:
    assert refusal(FCFS, [1], cache_salt="").field == "cache_salt"
    assert refusal(FCFS, [1], cache_salt="tenant-\ud800").field == "cache_salt"  # the step would fail hashing it
    FCFS.check([1], SamplingParams(max_tokens=1), cache_salt="tenant-a")
