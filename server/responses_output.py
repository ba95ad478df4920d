"""The Response object of /v1/responses and its stream events, built from the answer's pieces
(server/answer.py): reasoning becomes a `reasoning` item, the answer text a `message` item, each
tool call a `function_call` item, in the order they are written.

    response.created, response.in_progress
    per item: response.output_item.added
              message:   response.content_part.added, response.output_text.delta..., .output_text.done,
                         response.content_part.done
              reasoning: the same with response.reasoning_text.delta / .done
              call:      response.function_call_arguments.delta..., .function_call_arguments.done
              response.output_item.done
    response.completed (response.incomplete when max_output_tokens cut it off)

Every event carries a `sequence_number` (0, 1, ...) and is sent with its `event:` line. The
non-streamed Response is the stream's items built from the whole output at once; it equals the
streamed one except where text follows a tool call within one engine step (then the streamed
items keep the order in which they were decided).
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import RootModel

from kvserve.engine import FinishReason
from kvserve.server.answer import AnswerDelta, AnswerFormat, AnswerStream
from kvserve.server.engine_protocol import ServingTokenizer
from kvserve.server.errors import APIError
from kvserve.server.protocol import Usage
from kvserve.server.responder import Choice
from kvserve.server.streaming import named_sse_event


def new_item_id(prefix: str) -> str:
    """OpenAI's style for Responses ids: resp_…, msg_…, fc_…, rs_…"""
    return f"{prefix}_{uuid.uuid4().hex}"


class JsonObject(RootModel[dict[str, Any]]):
    """A response body built as plain JSON (the API's own shapes, not ours to model twice)."""


class ResponsesOutput:
    """Output items, built from answer deltas, and the events that announce each change."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written (the last of `items`)

    def feed(self, delta: AnswerDelta) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning:
            events += self._write("reasoning", delta.reasoning)
        if delta.content:
            events += self._write("message", delta.content)
        for entry in delta.tool_calls:
            function = entry["function"]
            if "id" in entry:
                events += self._close("completed")
                events += self._add({"id": new_item_id("fc"), "type": "function_call", "status": "in_progress",
                                     "call_id": entry["id"], "name": function["name"], "arguments": ""})
            if function["arguments"]:
                assert self._open is not None and self._open["type"] == "function_call"
                self._open["arguments"] += function["arguments"]
                events.append(self._event("response.function_call_arguments.delta", delta=function["arguments"]))
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Closes the last item (`status` "completed" or "incomplete"); an answer with no items at
        all is one empty message."""
        events = [] if self.items else self._open_text_item("message")
        return events + self._close(status)

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed") + self._open_text_item(kind)
        assert self._open is not None
        self._open["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(name, content_index=0, delta=text, **extra)]

    def _open_text_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": new_item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        events = self._add(item)
        item["content"].append(part)
        return events + [self._event("response.content_part.added", content_index=0, part=copy.deepcopy(part))]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", arguments=item["arguments"],
                                      name=item["name"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=[]))
            else:
                events.append(self._event("response.reasoning_text.done", content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", content_index=0, part=copy.deepcopy(part)))
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        self._open = None
        return events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert self._open is not None
        return {"type": kind, "item_id": self._open["id"], "output_index": len(self.items) - 1, **fields}

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning" and i["content"])

    def as_assistant_message(self) -> dict[str, Any]:
        """The output as the chat message a follow-up (previous_response_id) shows the model."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message" and i["content"])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        if calls:
            message["tool_calls"] = calls
        return message


def response_status(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The Response's status and incomplete_details for how its output ended."""
    if finish_reason == FinishReason.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == FinishReason.ABORT:
        return "cancelled", None
    return "completed", None


class ResponsesShape:
    """The EventShape of /v1/responses. `header` holds the Response's fields that echo the
    request; `on_finished` receives each finished Response (the store)."""

    def __init__(self, header: dict[str, Any], answer: AnswerFormat, tokenizer: ServingTokenizer,
                 on_finished: Callable[[dict[str, Any], ResponsesOutput], None]) -> None:
        self.header = header
        self.answer = answer
        self.tokenizer = tokenizer
        self.on_finished = on_finished
        self._sequence = itertools.count()
        self._stream = AnswerStream(answer)
        self._output = ResponsesOutput()
        self._finish_reason: str | None = None

    def _sse(self, events: list[dict[str, Any]]) -> list[str]:
        return [named_sse_event({**event, "sequence_number": next(self._sequence)}) for event in events]

    def opening_events(self) -> list[str]:
        started = self._response("in_progress", None, [], None)
        return self._sse([{"type": "response.created", "response": started},
                          {"type": "response.in_progress", "response": started}])

    def delta_events(self, choice: Choice) -> list[str]:
        output = choice.output
        events = self._output.feed(self._stream.feed(output.text, final=output.finished))
        if output.finished:
            self._finish_reason = output.finish_reason
            events += self._output.finish("incomplete" if output.finish_reason == FinishReason.LENGTH else "completed")
        return self._sse(events)

    def closing_events(self, usage: Usage) -> list[str]:
        response = self._finished(self._output, self._finish_reason, usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._sse([{"type": kind, "response": response}])

    def failure_events(self, error: APIError) -> list[str]:
        return self._sse([{"type": "error", "code": error.code or error.error_type, "message": error.message,
                           "param": error.param}])

    def response(self, choices: list[Choice], usage: Usage) -> JsonObject:
        [choice] = choices
        built = ResponsesOutput()
        built.feed(AnswerStream(self.answer).feed(choice.output.text, final=True))
        built.finish("incomplete" if choice.output.finish_reason == FinishReason.LENGTH else "completed")
        return JsonObject(self._finished(built, choice.output.finish_reason, usage))

    def _finished(self, output: ResponsesOutput, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
        status, incomplete = response_status(finish_reason)
        response = self._response(status, incomplete, output.items, self._usage(usage, output))
        self.on_finished(response, output)
        return response

    def _usage(self, usage: Usage, output: ResponsesOutput) -> dict[str, Any]:
        reasoning = output.reasoning_text()
        reasoning_tokens = min(len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0,
                               usage.completion_tokens)
        return {"input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": usage.total_tokens}

    def _response(self, status: str, incomplete: dict[str, Any] | None, items: list[dict[str, Any]],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        return {**self.header, "status": status, "incomplete_details": incomplete, "output": copy.deepcopy(items),
                "usage": usage}


def response_header(response_id: str, created_at: int, model: str, request: dict[str, Any], store: bool) -> dict[str, Any]:
    """The Response's fields that echo the request (`request` as the client sent it), in the
    order OpenAI writes them."""
    text = request.get("text") or {}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": None, "model": model, "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": store,
        "temperature": 1.0 if request.get("temperature") is None else request["temperature"],
        "text": {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity") or "medium"},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": [t for t in request.get("tools") or [] if t.get("type") == "function"],
        "top_logprobs": 0, "top_p": 1.0 if request.get("top_p") is None else request["top_p"],
        "truncation": "disabled", "usage": None, "user": request.get("user"), "metadata": request.get("metadata") or {},
    }
