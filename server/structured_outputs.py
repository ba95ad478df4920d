"""Structured-output request fields, in OpenAI's and vLLM's spellings, and their translation
into the engine's one StructuredOutputParams:

    response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}      (vLLM >= 0.10)
    guided_json | guided_regex | guided_choice | guided_grammar                       (vLLM, older)

At most one constraint per request. Whether the engine can compile it is the engine's call
(a 400 naming the field when it cannot): the engine knows the constraint only as the request's
"structured_output", so the server keeps the field it came from beside it (OutputConstraint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine import GrammarKind, StructuredOutputParams
from kvserve.server.errors import bad_request


@dataclass(frozen=True)
class OutputConstraint:
    """A request's output constraint and the request field it came from (its errors name it)."""

    params: StructuredOutputParams
    param: str


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputFields(BaseModel):
    """Mixed into the generation requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def output_constraint(request: StructuredOutputFields) -> OutputConstraint | None:
    found = [c for c in _candidates(request) if c is not None]
    if len(found) > 1:
        raise bad_request(f"Give at most one structured-output constraint; got {', '.join(c.param for c in found)}.",
                          found[1].param)
    return found[0] if found else None


def _candidates(request: StructuredOutputFields) -> list[OutputConstraint | None]:
    return [_from_response_format(request.response_format),
            *_from_structured_outputs(request.structured_outputs),
            _json("guided_json", request.guided_json),
            _text(GrammarKind.REGEX, "guided_regex", request.guided_regex),
            _choice("guided_choice", request.guided_choice),
            _text(GrammarKind.GRAMMAR, "guided_grammar", request.guided_grammar)]


def _from_response_format(response_format: ResponseFormat | None) -> OutputConstraint | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return OutputConstraint(StructuredOutputParams(GrammarKind.JSON_OBJECT), "response_format")
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema.",
                          "response_format.json_schema")
    return _json("response_format.json_schema.schema", spec.json_schema)


def _from_structured_outputs(field: StructuredOutputsField | None) -> list[OutputConstraint | None]:
    if field is None:
        return []
    param = "structured_outputs"
    json_object = OutputConstraint(StructuredOutputParams(GrammarKind.JSON_OBJECT), f"{param}.json_object") \
        if field.json_object else None
    return [_json(f"{param}.json", field.json_), _text(GrammarKind.REGEX, f"{param}.regex", field.regex),
            _choice(f"{param}.choice", field.choice), _text(GrammarKind.GRAMMAR, f"{param}.grammar", field.grammar),
            json_object]


def _json(param: str, schema: dict[str, Any] | str | None) -> OutputConstraint | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as error:
            raise bad_request(f"{param} is not valid JSON: {error}", param) from None
        text = schema
    else:
        text = json.dumps(schema)
    return OutputConstraint(StructuredOutputParams(GrammarKind.JSON_SCHEMA, text), param)


def _text(kind: GrammarKind, param: str, value: str | None) -> OutputConstraint | None:
    if value is None:
        return None
    if not value:
        raise bad_request(f"{param} must not be empty.", param)
    return OutputConstraint(StructuredOutputParams(kind, value), param)


def _choice(param: str, choices: list[str] | None) -> OutputConstraint | None:
    if choices is None:
        return None
    if not choices or not all(choices):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings.", param)
    return OutputConstraint(StructuredOutputParams(GrammarKind.CHOICE, json.dumps(choices)), param)
