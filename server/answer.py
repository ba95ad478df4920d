"""What a model's output means, independent of the API that reports it: reasoning (when the
server has a reasoning parser), answer text, and tool calls (when the request offers tools). The
chat, Responses and Messages shapes are all rendered from these pieces, streamed or whole.

    output text ──► ReasoningSplitter ──► reasoning
                                     └──► answer text ──► ToolCallStream ──► content, tool calls

The whole answer is the stream fed once with the whole text, so streamed pieces add up to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.reasoning import ReasoningSplitter
from kvserve.server.tool_calls import ToolMode
from kvserve.server.tool_parsers import ToolCallStream


@dataclass(frozen=True)
class AnswerFormat:
    """How one request's output is read."""

    tools: ToolMode | None = None
    reasoning_starts_open: bool | None = None  # None: the server has no reasoning parser


@dataclass(frozen=True)
class AnswerDelta:
    reasoning: str = ""
    content: str = ""
    # OpenAI's tool-call delta entries: {"index", "id", "type", "function": {"name", "arguments": ""}}
    # announces a call, {"index", "function": {"arguments": fragment}} continues it.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    has_calls: bool = False  # on the final delta: the answer ends in tool calls

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True)
class AnswerCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def arguments_object(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic's `input`); the parsers only report calls whose
        arguments are a JSON object."""
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Answer:
    reasoning: str | None  # None: no reasoning (or none written)
    content: str  # the answer text outside the calls ("" when there is none)
    calls: list[AnswerCall]


class AnswerStream:
    def __init__(self, answer_format: AnswerFormat) -> None:
        opens = answer_format.reasoning_starts_open
        self._reasoning = ReasoningSplitter(opens) if opens is not None else None
        tools = answer_format.tools
        self._tools = ToolCallStream(tools.parser, tools.new_id, tools.parallel_calls) if tools is not None else None

    def feed(self, text: str, final: bool) -> AnswerDelta:
        reasoning, content = "", text
        if self._reasoning is not None:
            split = self._reasoning.feed(text, final)
            reasoning, content = split.reasoning, split.content
        if self._tools is None:
            return AnswerDelta(reasoning, content)
        update = self._tools.feed(content, final)
        return AnswerDelta(reasoning, update.content, update.tool_calls, update.has_calls)


def whole_answer(answer_format: AnswerFormat, text: str) -> Answer:
    """The answer in one piece: the stream's pieces of one final feed, put together."""
    delta = AnswerStream(answer_format).feed(text, final=True)
    calls: list[AnswerCall] = []
    for entry in delta.tool_calls:
        function = entry["function"]
        if "id" in entry:
            calls.append(AnswerCall(entry["id"], function["name"], function["arguments"]))
        else:
            last = calls[-1]
            calls[-1] = AnswerCall(last.id, last.name, last.arguments + function["arguments"])
    if not delta.has_calls:
        calls = []
    return Answer(delta.reasoning or None, delta.content, calls)
