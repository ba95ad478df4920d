"""An Anthropic Messages request (POST /v1/messages), and its translation into the chat request
the chat path serves.

    system (string | text blocks)   a system message first
    messages, by content block      (system turns among them: system messages in place)
                                    text: the turn's text; tool_use (assistant): its tool_calls,
                                    `input` as JSON arguments; tool_result (user): a tool turn;
                                    thinking: dropped; image / document: a 400
    tools (input_schema)            function tools; server tools (typed, e.g. web_search_...) are
                                    ignored (X-Ignored-Fields)
    tool_choice                     auto / any (required) / tool (named) / none;
                                    disable_parallel_tool_use: parallel_tool_calls false
    max_tokens (required)           max_completion_tokens (above --max-tokens-per-request: that cap)
    output_config.format            response_format (json_schema through xgrammar)
    stop_sequences                  stop
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.request_body import parse_body
from kvserve.server.translation import fields_named

NO_EFFECT_FIELDS = frozenset({"metadata", "thinking", "service_tier", "container", "context_management",
                              "output_config"})
CHAT_FIELD_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                    "response_format": "output_config.format"}
_UNSUPPORTED_BLOCKS = {"image": "images", "document": "documents", "search_result": "search results"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False

    def unknown_fields(self) -> list[str]:
        return sorted(name for name in (self.model_extra or {}) if name not in NO_EFFECT_FIELDS)


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # count_tokens takes no budget


@dataclass(frozen=True)
class TranslatedRequest:
    chat: ChatCompletionRequest
    ignored: list[str]  # server tools left out, for X-Ignored-Fields


def translate(body: MessagesRequest, max_tokens_cap: int) -> TranslatedRequest:
    """`max_tokens_cap` is the server's --max-tokens-per-request: Anthropic's clients must send
    max_tokens and send large ones (Claude Code 32000) as a ceiling, so one above the cap means
    "as many as the server allows" rather than a 400."""
    messages = _system(body.system) + _messages(body.messages)
    if messages[-1]["role"] == "assistant":
        raise bad_request("A final assistant message (prefill) is not supported by this server: end the messages "
                          "with a user turn.", f"messages[{len(body.messages) - 1}]")
    tools, ignored = _function_tools(body.tools)
    budget = body.max_tokens if body.max_tokens <= max_tokens_cap else None  # None: the rest of the context, capped
    chat: dict[str, Any] = {"messages": messages, "max_completion_tokens": budget, "stream": body.stream,
                            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                            "stop": body.stop_sequences}
    choice = body.tool_choice or {"type": "auto"}
    if tools and choice.get("type") != "none":
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(choice)
        chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    elif choice.get("type") in ("any", "tool"):
        raise bad_request("tool_choice needs tools to choose from.", "tool_choice")
    output_format = (body.model_extra or {}).get("output_config") or {}
    output_format = output_format.get("format") if isinstance(output_format, dict) else None
    if isinstance(output_format, dict) and output_format.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": output_format.get("schema")}}
    with fields_named(CHAT_FIELD_NAMES):
        return TranslatedRequest(parse_body(ChatCompletionRequest, chat), ignored)


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    text = system if isinstance(system, str) else "".join(_text_block(b, f"system[{i}]") for i, b in enumerate(system))
    return [{"role": "system", "content": text}]


def _messages(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        role = turn.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}.", f"{where}.role")
        content = turn.get("content")
        if role == "system":  # Claude Code sends its environment notes as system turns between the others
            messages += _system(content if isinstance(content, (str, list)) else "")
        elif isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif isinstance(content, list):
            messages += _assistant_turn(content, where) if role == "assistant" else _user_turn(content, where)
        else:
            raise bad_request(f"{where}.content must be a string or a list of content blocks.", f"{where}.content")
    return messages


def _user_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results become tool turns, text between them user turns, in the order sent."""
    messages: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if _kind(block, at) == "tool_result":
            result = block.get("content", "")
            text = result if isinstance(result, str) else "".join(
                _text_block(b, f"{at}.content[{k}]") for k, b in enumerate(result))
            messages.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": text})
        elif messages and messages[-1]["role"] == "user":
            messages[-1]["content"] += _text_block(block, at)
        else:
            messages.append({"role": "user", "content": _text_block(block, at)})
    return messages


def _assistant_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at)
        if kind == "tool_use":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            message.setdefault("tool_calls", []).append(
                {"id": _string(block, "id", at), "type": "function",
                 "function": {"name": _string(block, "name", at), "arguments": arguments}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            message["content"] += _text_block(block, at)
    return [message]


def _kind(block: Any, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{at} must be a content block with a 'type'.", at)
    return block["type"]


def _text_block(block: Any, at: str) -> str:
    kind = _kind(block, at)
    if kind == "text":
        return _string(block, "text", at)
    if kind in _UNSUPPORTED_BLOCKS:
        raise bad_request(f"{at}: {_UNSUPPORTED_BLOCKS[kind]} are not supported: this server serves a text-only "
                          "model.", f"{at}.type")
    raise bad_request(f"{at}: content blocks of type {kind!r} are not supported here.", f"{at}.type")


def _string(block: dict[str, Any], key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{at}.{key} must be a string.", f"{at}.{key}")
    return value


def _function_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[str]]:
    functions, ignored = [], []
    for i, tool in enumerate(tools or []):
        if tool.get("type") not in (None, "custom"):
            ignored.append(f"tools[{i}] ({tool.get('type')})")
            continue
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    return functions, ignored


def _tool_choice(choice: dict[str, Any]) -> str | dict[str, Any]:
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(f"tool_choice.type must be auto, any, tool or none; got {kind!r}.", "tool_choice.type")
