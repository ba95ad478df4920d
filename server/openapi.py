"""/openapi.json with the request bodies and the error body described.

The routes read their bodies themselves (size cap first, then JSON, then the pydantic model; see
request_body.py), so FastAPI cannot see the models and would publish operations without bodies,
useless to client generators and schema-driven testers. This adds, to the generated document,
each route's pydantic request model as its `requestBody` and OpenAI's error body as its 4xx/5xx
response, with every model under `components/schemas`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvserve.server.anthropic_request import CountTokensRequest, MessagesRequest
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvserve.server.responses_request import ResponsesRequest

REQUEST_BODIES: Mapping[tuple[str, str], type[BaseModel]] = {
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/responses", "post"): ResponsesRequest,
    ("/v1/responses/input_tokens", "post"): ResponsesRequest,
    ("/v1/messages", "post"): MessagesRequest,
    ("/v1/messages/count_tokens", "post"): CountTokensRequest,
    ("/tokenize", "post"): TokenizeRequest,
    ("/detokenize", "post"): DetokenizeRequest,
}
_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """Every error: `{"error": {"message", "type", "param", "code"}}` (see errors.py)."""

    error: ErrorDetail


def install_openapi(app: FastAPI, bodies: Mapping[tuple[str, str], type[BaseModel]] = REQUEST_BODIES) -> None:
    """Replaces `app.openapi` (FastAPI's documented hook) with the completed document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document(app: FastAPI, bodies: Mapping[tuple[str, str], type[BaseModel]]) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    models = [*dict.fromkeys(bodies.values()), ErrorResponse]
    _, definitions = models_json_schema([(model, "validation") for model in models], ref_template=_REF)
    document.setdefault("components", {}).setdefault("schemas", {}).update(definitions["$defs"])
    error = {"description": "An OpenAI-style error",
             "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            model = bodies.get((path, method))
            if model is not None:
                operation["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}
            operation["responses"].pop("422", None)  # FastAPI's own validation body is never sent
            operation["responses"].setdefault("4XX", error)
            operation["responses"].setdefault("5XX", error)
    return document
