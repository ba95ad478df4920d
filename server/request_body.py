"""Reads and validates a JSON request body before anything else touches it: size cap (413),
content type, JSON syntax and the decoder's bounds (400, see bounded_json.py), then the pydantic
model (400 naming the field)."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvserve.server.bounded_json import BodyJSONError, decode_json
from kvserve.server.errors import bad_request, payload_too_large, validation_param

ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_json_body(request: Request, max_bytes: int) -> Any:
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise bad_request(f"Unsupported content type {content_type or '(none)'!r}: send a JSON body with "
                          "'Content-Type: application/json'.", code="invalid_content_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise payload_too_large(max_bytes)
    # Count while reading too: a chunked body has no Content-Length to trust.
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise payload_too_large(max_bytes)
        chunks.append(chunk)
    try:
        return decode_json(b"".join(chunks))
    except BodyJSONError as error:
        raise bad_request(str(error), code=error.code) from None


def parse_body(model: type[ModelT], body: Any) -> ModelT:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = validation_param(tuple(first["loc"]))
        raise bad_request(f"Invalid value for '{param or 'request'}': {first['msg']}", param) from None
