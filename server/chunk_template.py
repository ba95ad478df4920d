"""The plain /v1/completions stream chunk (text only: no logprobs, no prompt logprobs), rendered
from a template instead of through pydantic.

Streaming sends one chunk per token per request, on the event loop that shares the cores (and
the GIL) with the model step: building and validating two pydantic models and dumping them costs
~25 us a chunk, the template ~1 us. The bytes are exactly `sse_event(CompletionResponse(...))`'s:
the fixed fields are serialised once, and every variable value goes through pydantic_core's own
JSON encoder, the one `model_dump_json` uses (same string escaping, same number format).
tests/server/test_chunk_template.py compares the two.
"""

from __future__ import annotations

from pydantic_core import to_json


class CompletionChunkTemplate:
    def __init__(self, response_id: str, created: int, model: str) -> None:
        self._head = (f'data: {{"id":{_json(response_id)},"object":"text_completion","created":{_json(created)},'
                      f'"model":{_json(model)},"choices":[{{"index":')

    def event(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        """The SSE event of a chunk whose one choice carries `text` and nothing optional."""
        return (f'{self._head}{index},"text":{_json(text)},"logprobs":null,"finish_reason":{_json(finish_reason)},'
                f'"stop_reason":{_json(stop_reason)},"prompt_logprobs":null}}],"usage":null}}\n\n')


def _json(value: object) -> str:
    return to_json(value).decode()
