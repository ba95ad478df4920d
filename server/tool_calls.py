"""Tool calls on /v1/chat/completions when the client forces them: `tool_choice` "required" or a
named function. The grammar engine then guarantees the output's shape, so the server only wraps
it as OpenAI's `tool_calls`:

    named function   output = the arguments object (schema: the function's parameters)
    required         output = [{"name": ..., "parameters": {...}}, ...]  (one item unless
                     parallel_tool_calls), each item one of the tools' schemas

`tool_choice` "none" renders no tools and calls none. "auto" (the model decides, parsed from its
own format by a per-family parser) is not implemented: it gets a 400 saying so.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine import GrammarKind, StructuredOutputParams
from kvserve.server.errors import bad_request


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclass(frozen=True)
class ToolMode:
    """How this request calls tools: the constraint the engine enforces, and how to read the
    output back."""

    constraint: StructuredOutputParams
    named: str | None  # the forced function's name; None for "required"


def tool_mode(tools: list[ToolDefinition] | None, tool_choice: str | NamedToolChoice | None,
              parallel_tool_calls: bool) -> ToolMode | None:
    if not tools:
        if isinstance(tool_choice, NamedToolChoice) or tool_choice == "required":
            raise bad_request("tool_choice needs tools to choose from.", "tool_choice")
        return None
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):  # OpenAI's default with tools is "auto"
        raise bad_request("tool_choice 'auto' (the default when tools are given) needs a tool-call parser, which "
                          "this server does not have yet; use 'required' or a named function (both enforced by "
                          "the grammar engine), or 'none'.", "tool_choice")
    by_name = {tool.function.name: tool.function for tool in tools}
    if isinstance(tool_choice, NamedToolChoice):
        function = by_name.get(tool_choice.function.name)
        if function is None:
            raise bad_request(f"tool_choice names {tool_choice.function.name!r}, which is not among the tools.",
                              "tool_choice")
        schema = json.dumps(_parameters(function))
        return ToolMode(StructuredOutputParams(GrammarKind.JSON_SCHEMA, schema, param="tools"), function.name)
    item = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": _parameters(f)},
                       "required": ["name", "parameters"], "additionalProperties": False}
                      for f in by_name.values()]}
    array = {"type": "array", "items": item, "minItems": 1, **({} if parallel_tool_calls else {"maxItems": 1})}
    return ToolMode(StructuredOutputParams(GrammarKind.JSON_SCHEMA, json.dumps(array), param="tools"), None)


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters or {"type": "object", "properties": {}}


def tool_calls_from_output(mode: ToolMode, text: str) -> list[ToolCall] | None:
    """The calls in a finished constrained output; None when it is not complete JSON (the output
    hit max_tokens first), in which case the text is returned as content."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if mode.named is not None:
        return [_call(mode.named, value)]
    return [_call(item["name"], item["parameters"]) for item in value]


def _call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def template_tools(tools: list[ToolDefinition] | None, mode: ToolMode | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates expect them (OpenAI's shape), or None when none are offered."""
    if not tools or mode is None:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]
