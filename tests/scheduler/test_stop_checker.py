"""Stop checks after each sampled token, in order: stop tokens / EOS, max_tokens, max_model_len."""

from __future__ import annotations

from kvserve.scheduler import FinishReason, Request
from kvserve.scheduler.stop_checker import check_stop
from tests.scheduler.harness import make_request

EOS = 2


def after(tokens: list[int], **params: object) -> Request:
    request = make_request("r", [5, 6, 7], eos=EOS, **params)
    for token in tokens:
        request.append_output_token(token)
    return request


def test_eos_stops_without_a_stop_reason() -> None:
    request = after([9, EOS])
    assert check_stop(request, 1000)
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, None)


def test_stop_token_reports_itself() -> None:
    request = after([11], stop_token_ids=[11, 12])
    assert check_stop(request, 1000)
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, 11)


def test_ignore_eos_ignores_eos_but_not_stop_tokens() -> None:
    assert not check_stop(after([EOS], ignore_eos=True), 1000)
    request = after([12], ignore_eos=True, stop_token_ids=[12])
    assert check_stop(request, 1000) and request.stop_reason == 12


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    assert not check_stop(after([EOS], min_tokens=2), 1000)
    assert not check_stop(after([12], min_tokens=2, stop_token_ids=[12]), 1000)
    assert check_stop(after([4, EOS], min_tokens=2), 1000)


def test_stop_token_wins_over_max_tokens() -> None:
    request = after([4, EOS], max_tokens=2)
    assert check_stop(request, 1000) and request.finish_reason is FinishReason.STOP


def test_max_tokens_is_length() -> None:
    request = after([4, 4], max_tokens=2)
    assert check_stop(request, 1000) and request.finish_reason is FinishReason.LENGTH
    assert not check_stop(after([4], max_tokens=2), 1000)


def test_max_model_len_is_length() -> None:
    # 3 prompt tokens + 2 outputs = 5 tokens.
    request = after([4, 4], max_tokens=None)
    assert check_stop(request, 5) and request.finish_reason is FinishReason.LENGTH
    assert not check_stop(after([4], max_tokens=None), 5)
    # max_model_len applies even before min_tokens is reached.
    assert check_stop(after([4, 4], max_tokens=None, min_tokens=4), 5)
