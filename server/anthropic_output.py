"""Anthropic's Message object and its stream, built from the answer's pieces (server/answer.py):
reasoning becomes a `thinking` block, answer text a `text` block, each tool call a `tool_use`
block (its arguments parsed into `input`), in the order they are written.

    message_start, ping
    per block: content_block_start, content_block_delta... (thinking_delta / text_delta /
               input_json_delta), content_block_stop
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop

Each event is sent with its `event:` line (the SDKs dispatch on it). Errors have Anthropic's
shape, `{"type": "error", "error": {"type", "message"}}`, as a body or as an `error` event.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from kvserve.engine import FinishReason
from kvserve.server.answer import AnswerDelta, AnswerFormat, AnswerStream
from kvserve.server.errors import APIError
from kvserve.server.protocol import Usage
from kvserve.server.responder import Choice
from kvserve.server.responses_output import JsonObject
from kvserve.server.streaming import named_sse_event

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_body(error: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    message = error.message
    if error.code == "context_length_exceeded":  # Anthropic's wording, which clients (Claude Code) look for
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


class MessageBlocks:
    """Content blocks, built from answer deltas, and the events that announce each change."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._arguments: dict[int, str] = {}  # per tool_use block: its arguments' JSON text so far
        self._open = False

    def feed(self, delta: AnswerDelta) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning:
            events += self._write("thinking", delta.reasoning)
        if delta.content:
            events += self._write("text", delta.content)
        for entry in delta.tool_calls:
            function = entry["function"]
            if "id" in entry:
                events += self._start({"type": "tool_use", "id": entry["id"], "name": function["name"], "input": {}})
                self._arguments[len(self.blocks) - 1] = ""
            if function["arguments"]:
                self._arguments[len(self.blocks) - 1] += function["arguments"]
                events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    def finish(self) -> list[dict[str, Any]]:
        events = self._stop()
        for index, text in self._arguments.items():
            self.blocks[index]["input"] = _object(text)
        return events

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if not self._open or self.blocks[-1]["type"] != kind:
            events += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                  else {"type": "text", "text": ""})
        self.blocks[-1][kind] += text
        return events + [self._delta({"type": f"{kind}_delta", kind: text})]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self.blocks.append(block)
        self._open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _stop(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _object(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:  # a call cut off by max_tokens after it was announced
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(delta_has_calls: bool, finish_reason: str | None, matched: int | str | None,
                stop_sequences: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for how the output ended."""
    if delta_has_calls:
        return "tool_use", None
    if finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


class MessagesShape:
    """The EventShape of /v1/messages."""

    def __init__(self, message_id: str, model: str, answer: AnswerFormat, prompt_tokens: int,
                 stop_sequences: list[str]) -> None:
        self.header = {"id": message_id, "type": "message", "role": "assistant", "model": model}
        self.answer = answer
        self.prompt_tokens = prompt_tokens
        self.stop_sequences = stop_sequences
        self._stream = AnswerStream(answer)
        self._blocks = MessageBlocks()
        self._stop: tuple[str, str | None] = ("end_turn", None)

    def opening_events(self) -> list[str]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        started = {**self.header, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [named_sse_event({"type": "message_start", "message": started}), named_sse_event({"type": "ping"})]

    def delta_events(self, choice: Choice) -> list[str]:
        output = choice.output
        delta = self._stream.feed(output.text, final=output.finished)
        events = self._blocks.feed(delta)
        if output.finished:
            events += self._blocks.finish()
            self._stop = stop_reason(delta.has_calls, output.finish_reason, output.stop_reason, self.stop_sequences)
        return [named_sse_event(event) for event in events]

    def closing_events(self, usage: Usage) -> list[str]:
        reason, sequence = self._stop
        return [named_sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": _usage(usage)}),
                named_sse_event({"type": "message_stop"})]

    def failure_events(self, error: APIError) -> list[str]:
        return [named_sse_event(error_body(error))]

    def response(self, choices: list[Choice], usage: Usage) -> JsonObject:
        [choice] = choices
        output = choice.output
        delta = AnswerStream(self.answer).feed(output.text, final=True)
        blocks = MessageBlocks()
        blocks.feed(delta)
        blocks.finish()
        reason, sequence = stop_reason(delta.has_calls, output.finish_reason, output.stop_reason, self.stop_sequences)
        return JsonObject({**self.header, "content": blocks.blocks, "stop_reason": reason, "stop_sequence": sequence,
                           "usage": _usage(usage)})


def _usage(usage: Usage) -> dict[str, Any]:
    """Anthropic counts cached prompt tokens apart from input_tokens."""
    cached = usage.prompt_tokens_details.cached_tokens
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
