"""The engine's refusals name the engine's fields; the server's error bodies name the request's
fields, spelled as the API that was called spells them, with OpenAI's error codes."""

from __future__ import annotations

import pytest

from kvserve.engine import AdmissionError, PromptTooLongError, SamplingParams, SamplingParamsError
from kvserve.engine.structured_output import StructuredOutputError
from kvserve.server.errors import APIError, refused
from kvserve.server.translation import fields_named

CHAT = {"max_tokens": "max_completion_tokens", "structured_output": "response_format.json_schema.schema"}


def test_a_prompt_too_long_for_its_budget_names_the_requests_budget_field() -> None:
    error = refused(PromptTooLongError(10, 7, 16), CHAT)
    assert error.body() == {"error": {
        "message": "This model's maximum context length is 16 tokens. However, you requested 17 tokens (10 in the "
                   "prompt, 7 for the completion). Please reduce the prompt or max_completion_tokens.",
        "type": "invalid_request_error", "param": "max_completion_tokens", "code": "context_length_exceeded"}}


def test_a_prompt_too_long_alone_names_the_prompt() -> None:
    error = refused(PromptTooLongError(16, None, 16), CHAT)
    assert (error.param, error.code) == ("prompt", "context_length_exceeded")
    assert error.message == "This model's maximum context length is 16 tokens, but the prompt has 16 tokens. " \
                            "Please shorten the prompt."


def test_an_uncompilable_constraint_names_the_field_it_came_from() -> None:
    error = refused(StructuredOutputError("the json_schema constraint cannot be compiled: bad type"), CHAT)
    assert error.body()["error"] == {
        "message": "response_format.json_schema.schema: the json_schema constraint cannot be compiled: bad type",
        "type": "invalid_request_error", "param": "response_format.json_schema.schema", "code": None}


def test_fields_spelled_alike_pass_through_without_a_code() -> None:
    error = refused(AdmissionError("logit_bias token id 500 is outside the vocabulary [0, 100).", "logit_bias"), CHAT)
    assert (error.status, error.param, error.code) == (400, "logit_bias", None)


def test_sampling_params_errors_name_the_requests_field() -> None:
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(logprobs=-1)
    assert raised.value.field == "logprobs"
    error = refused(raised.value, {"logprobs": "top_logprobs"})
    assert (error.param, error.message) == ("top_logprobs", "logprobs must be a non-negative integer, got -1")


def test_a_translated_api_sees_its_own_names() -> None:
    """Responses' budget is max_output_tokens: the chat name is renamed in param and message."""
    with pytest.raises(APIError) as raised:
        with fields_named({"max_completion_tokens": "max_output_tokens"}):
            raise refused(PromptTooLongError(10, 7, 16), CHAT)
    assert raised.value.param == "max_output_tokens"
    assert raised.value.message.endswith("Please reduce the prompt or max_output_tokens.")
