"""Tool calls on /v1/chat/completions: which of OpenAI's tool_choice modes a request asks for,
the constraint the engine enforces for it, and the parser that reads its calls back:

    none             tools are not rendered; the answer is text
    auto             the model decides; its calls are parsed out of its text by the family parser
                     chosen with --tool-call-parser (needs --enable-auto-tool-choice, as vLLM);
                     without parallel_tool_calls only the first call is returned (as vLLM)
    required         the grammar forces [{"name": ..., "parameters": {...}}, ...] (one item unless
                     parallel_tool_calls), each item one of the tools' schemas
    named function   the grammar forces the arguments object (schema: the function's parameters)

tool_choice omitted with tools given means "auto", as in OpenAI's API.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine import GrammarKind, StructuredOutputParams
from kvserve.server.errors import bad_request
from kvserve.server.structured_outputs import OutputConstraint
from kvserve.server.tool_parsers import OutputParser, named_call_parser, parse_required

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                    '(tool_choice is "auto" when tools are given without it); or use "required", a named '
                    'function (both enforced by the grammar engine) or "none".')


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
    """How this request calls tools: the constraint the engine enforces (None for "auto"), and
    how to read the calls back out of the output."""

    constraint: OutputConstraint | None
    parser: OutputParser
    new_id: Callable[[], str]  # the calls' ids
    parallel_calls: bool  # parallel_tool_calls: false keeps only the first call, as vLLM


def tool_mode(tools: list[ToolDefinition] | None, tool_choice: str | NamedToolChoice | None,
              parallel_tool_calls: bool, auto_parser: OutputParser | None,
              new_id: Callable[[], str]) -> ToolMode | None:
    """`auto_parser` is the server's --tool-call-parser when auto tool choice is enabled."""
    if not tools:
        if isinstance(tool_choice, NamedToolChoice) or tool_choice == "required":
            raise bad_request("tool_choice needs tools to choose from.", "tool_choice")
        return None
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):  # OpenAI's default with tools is "auto"
        if auto_parser is None:
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolMode(None, auto_parser, new_id, parallel_tool_calls)
    by_name = {tool.function.name: tool.function for tool in tools}
    if isinstance(tool_choice, NamedToolChoice):
        function = by_name.get(tool_choice.function.name)
        if function is None:
            raise bad_request(f"tool_choice names {tool_choice.function.name!r}, which is not among the tools.",
                              "tool_choice")
        schema = json.dumps(_parameters(function))
        return ToolMode(OutputConstraint(StructuredOutputParams(GrammarKind.JSON_SCHEMA, schema), "tools"),
                        named_call_parser(function.name), new_id, parallel_tool_calls)
    item = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": _parameters(f)},
                       "required": ["name", "parameters"], "additionalProperties": False}
                      for f in by_name.values()]}
    array = {"type": "array", "items": item, "minItems": 1, **({} if parallel_tool_calls else {"maxItems": 1})}
    constraint = OutputConstraint(StructuredOutputParams(GrammarKind.JSON_SCHEMA, json.dumps(array)), "tools")
    return ToolMode(constraint, parse_required, new_id, parallel_tool_calls)


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters or {"type": "object", "properties": {}}


def template_tools(tools: list[ToolDefinition] | None, mode: ToolMode | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates expect them (OpenAI's shape), or None when none are offered."""
    if not tools or mode is None:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]
