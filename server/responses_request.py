"""A /v1/responses request, and its translation into the chat request the chat path serves.

    input (string | items)        messages: message items by role, function_call items as the
                                  assistant's tool_calls, function_call_output items as tool turns
    instructions                  a system message first (not carried over by previous_response_id)
    previous_response_id          the stored conversation of that response goes first
    tools (type function)         tools; built-in tool types are ignored (X-Ignored-Fields)
    tool_choice                   none / auto / required / {"type": "function", "name"} /
                                  {"type": "allowed_tools", "mode", "tools"}
    text.format                   response_format (json_schema / json_object through xgrammar)
    max_output_tokens             max_completion_tokens

Reasoning items in `input` are dropped (the chat templates this server knows do not show past
thinking); images, files and audio get a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.request_body import parse_body
from kvserve.server.translation import fields_named

# Accepted and without effect here (OpenAI's hosting options, reasoning effort, ...).
NO_EFFECT_FIELDS = frozenset({"user", "metadata", "reasoning", "include", "truncation", "service_tier",
                              "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "stream_options",
                              "max_tool_calls", "store", "top_logprobs", "client_metadata"})
# vLLM's sampling extensions, passed to the chat path as they are.
SAMPLING_EXTENSIONS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
                       "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "priority", "cache_salt")
# What the chat path's errors call the fields, in this API's names.
CHAT_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text.format"}
_UNSUPPORTED_CONTENT = {"input_image": "images", "input_file": "files", "input_audio": "audio"}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        shown = {"type": self.type}
        if self.type == "json_schema":
            shown.update(name=self.name, description=self.description, schema=self.schema_, strict=self.strict)
        return shown


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    def unknown_fields(self) -> list[str]:
        return sorted(name for name in (self.model_extra or {})
                      if name not in NO_EFFECT_FIELDS and name not in SAMPLING_EXTENSIONS)


@dataclass(frozen=True)
class TranslatedRequest:
    chat: ChatCompletionRequest
    conversation: list[dict[str, Any]]  # the messages after the instructions: what a stored response continues
    ignored: list[str]  # built-in tools left out, for X-Ignored-Fields


def translate(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> TranslatedRequest:
    """`earlier` is the stored conversation of previous_response_id ([] without one)."""
    if body.background:
        raise bad_request("background responses are not supported by this server; remove 'background'.",
                          "background")
    for name in ("conversation", "prompt"):
        if getattr(body, name) is not None:
            raise bad_request(f"'{name}' is not supported by this server (use previous_response_id or send the "
                              "input); remove it.", name)
    conversation = earlier + input_messages(body.input)
    if not conversation:
        raise bad_request("input must not be empty.", "input")
    tools, ignored = _function_tools(body.tools)
    tool_choice, tools = _tool_choice(body.tool_choice, tools)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {
        "messages": system + conversation, "stream": body.stream, "temperature": body.temperature,
        "top_p": body.top_p, "max_completion_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        **{name: value for name, value in (body.model_extra or {}).items() if name in SAMPLING_EXTENSIONS}}
    if tools:
        chat["tools"] = tools
        if tool_choice is not None:
            chat["tool_choice"] = tool_choice
    elif tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs function tools to choose from.", "tool_choice")
    response_format = _response_format(body.text)
    if response_format is not None:
        chat["response_format"] = response_format
    with fields_named(CHAT_FIELD_NAMES):
        return TranslatedRequest(parse_body(ChatCompletionRequest, chat), conversation, ignored)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be one of user, system, developer, assistant; got {role!r}.",
                                  f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant" and messages and messages[-1]["role"] == "assistant" and \
                    not messages[-1].get("tool_calls"):
                messages[-1]["content"] += text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported by this server "
                              "(message, function_call, function_call_output and reasoning are).", f"{where}.type")
    return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string.", f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A string, or a list of text parts (input_text, output_text, refusal) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts.", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(_string(part, "text", f"{where}[{j}]"))
        elif kind == "refusal":
            texts.append(_string(part, "refusal", f"{where}[{j}]"))
        elif kind in _UNSUPPORTED_CONTENT:
            raise bad_request(f"{where}[{j}]: {_UNSUPPORTED_CONTENT[kind]} are not supported: this server serves a "
                              "text-only model.", f"{where}[{j}].type")
        else:
            raise bad_request(f"{where}[{j}]: content parts of type {kind!r} are not supported.", f"{where}[{j}].type")
    return "".join(texts)


def _function_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[str]]:
    """The function tools in chat's shape, and the built-in ones left out (named for the client)."""
    functions, ignored = [], []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            ignored.append(f"tools[{i}] ({tool.get('type')})")
            continue
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
        functions.append({"type": "function", "function": function})
    return functions, ignored


def _tool_choice(choice: str | dict[str, Any] | None,
                 tools: list[dict[str, Any]]) -> tuple[str | dict[str, Any] | None, list[dict[str, Any]]]:
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}, tools
    if kind == "allowed_tools":
        allowed = {t.get("name") for t in choice.get("tools", []) if t.get("type") == "function"}
        return choice.get("mode", "auto"), [t for t in tools if t["function"]["name"] in allowed]
    raise bad_request(f"tool_choice of type {kind!r} is not supported: this server runs function tools only.",
                      "tool_choice")


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    if text is None or text.format is None or text.format.type == "text":
        return None
    if text.format.type == "json_object":
        return {"type": "json_object"}
    if text.format.schema_ is None:
        raise bad_request("text.format of type json_schema needs a schema.", "text.format.schema")
    spec = {"name": text.format.name or "response", "schema": text.format.schema_}
    if text.format.strict is not None:
        spec["strict"] = text.format.strict
    return {"type": "json_schema", "json_schema": spec}
