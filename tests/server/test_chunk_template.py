"""The plain completion chunk's template gives exactly the bytes pydantic gives for the same chunk."""

from __future__ import annotations

import pytest

from kvserve.engine import FinishReason
from kvserve.server.chunk_template import CompletionChunkTemplate
from kvserve.server.protocol import CompletionChoice, CompletionResponse
from kvserve.server.streaming import sse_event

TEXTS = ["", " water", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x01\x1f\x7f", "é 中文 🙂",
         "\u2028\u2029", "\ufffd", "</script>", "a" * 300]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("finish_reason", "stop_reason"),
                         [(None, None), (FinishReason.LENGTH, None), (FinishReason.STOP, 2), (FinishReason.STOP, "END\n"),
                          ("abort", None)])
def test_template_event_equals_the_pydantic_event(text: str, finish_reason: str | None,
                                                  stop_reason: int | str | None) -> None:
    response_id, created, model = 'cmpl-1"é', 1_700_000_000, "org/Model-\u00e9"
    expected = sse_event(CompletionResponse(
        id=response_id, created=created, model=model,
        choices=[CompletionChoice(index=17, text=text, finish_reason=finish_reason, stop_reason=stop_reason)]))
    got = CompletionChunkTemplate(response_id, created, model).event(17, text, finish_reason, stop_reason)
    assert got == expected
