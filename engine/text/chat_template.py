"""Rendering a model's chat template (Jinja, as Hugging Face defines it) into a prompt string.

Templates come from model files, which anyone can publish, so they render in Jinja's
`ImmutableSandboxedEnvironment`: no access to dunder attributes (the classic
`''.__class__.__mro__` escape), no calling unsafe methods, no mutating the messages passed in.
The environment otherwise matches transformers' (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text) so a template renders
byte-for-byte as it does there.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat request cannot be rendered: no template, malformed messages, or the template
    itself refused them (via raise_exception) or failed."""


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` marks assistant text for training
    masks; for inference it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so `{% set ns.__x__ = ... %}` cannot reach
    Python internals through the namespace object."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `self` may be a key
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r} on a namespace")


def _make_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
    # A plain function rather than the `dict` type itself, so `dict.__class__`-style lookups have
    # nothing to walk.
    return dict(*args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    env.globals["dict"] = _make_dict
    return env


class ChatTemplate:
    """One compiled template; `render` may be called concurrently (it keeps no state)."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile (line {exc.lineno}): {exc.message}") from exc
        self._special_tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
        checked = validate_messages(messages)
        try:
            return self._template.render(messages=checked, tools=tools, add_generation_prompt=add_generation_prompt,
                                         **self._special_tokens, **extra)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"the chat template tried an operation the sandbox forbids: {exc}") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from exc


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Checked copies of the messages: each has a non-empty string `role` and text `content`.

    OpenAI-style content parts ([{"type": "text", "text": ...}, ...]) are joined with newlines,
    because text-only templates concatenate `message['content']` as a string. A message may omit
    content only when it carries `tool_calls`.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}] needs a non-empty string 'role' (e.g. 'system', 'user', 'assistant')")
        copy = dict(message)
        copy["content"] = _content_text(message.get("content"), i, has_tool_calls=bool(message.get("tool_calls")))
        checked.append(copy)
    return checked


def _content_text(content: Any, index: int, *, has_tool_calls: bool) -> str | None:
    if isinstance(content, str):
        return content
    if content is None:
        if has_tool_calls:
            return None
        raise ChatTemplateError(f"messages[{index}] has no 'content'")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatTemplateError(f"messages[{index}].content: only text parts "
                                        "({'type': 'text', 'text': ...}) are supported by this model")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts, "
                            f"got {type(content).__name__}")
