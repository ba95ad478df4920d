"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Routes raise `APIError` (built by the small constructors below); the handlers installed by
`install_error_handlers` turn it, FastAPI's own errors and (UnexpectedErrorMiddleware) any
unexpected exception into that body, so a client never sees an HTML page or a bare stack trace.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.engine import AdmissionError, PromptTooLongError, SamplingParamsError

logger = logging.getLogger(__name__)

# nginx's convention for "client closed the request": nobody reads it, but logs and metrics do.
CLIENT_CLOSED_REQUEST = 499


class APIError(Exception):
    def __init__(self, status: int, message: str, *, error_type: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before the response was ready; its work has been aborted."""


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, error_type="invalid_request_error", param=param, code=code)


def model_not_found(requested: str, served: str) -> APIError:
    return APIError(404, f"The model {requested!r} does not exist. This server serves {served!r}.",
                    error_type="invalid_request_error", param="model", code="model_not_found")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, error_type="invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body exceeds the server's limit of {limit} bytes; "
                    "send fewer or shorter prompts.", error_type="invalid_request_error",
                    code="request_too_large")


def unavailable(message: str, retry_after_s: int | None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, error_type="server_error", code="service_unavailable", headers=headers)


def engine_failed(error: BaseException) -> APIError:
    return APIError(500, f"The inference engine failed while serving this request: {error}. "
                    "The server must be restarted.", error_type="server_error", code="engine_error")


def check_model(requested: str | None, served: str) -> None:
    """A request may omit `model`; if it names one, it must be the one this server serves."""
    if requested is not None and requested != served:
        raise model_not_found(requested, served)


def refused(error: AdmissionError | SamplingParamsError, renamed: Mapping[str, str] | None = None) -> APIError:
    """The engine's refusal as a 400. The engine names its own fields (SamplingParams' and
    add_request's: "max_tokens", "logprobs", "structured_output", "prompt", ...); `renamed` maps
    those that this request spells otherwise to its names (chat's max_completion_tokens, the
    field an output constraint came from). OpenAI's error codes are picked here, not below."""
    renamed = renamed or {}
    param = renamed.get(error.field, error.field)
    if isinstance(error, PromptTooLongError):
        return bad_request(error.describe(renamed.get("max_tokens", "max_tokens")), param,
                           code="context_length_exceeded")
    if error.field == "structured_output":  # "the json_schema constraint cannot be compiled: ..."
        return bad_request(f"{param}: {error}", param)
    return bad_request(str(error), param)


def error_from_engine(error: Exception, engine_dead: bool) -> APIError:
    """What a failure raised by `engine.generate` means for the client."""
    if isinstance(error, AdmissionError) and not engine_dead:
        return refused(error)
    if isinstance(error, ValueError) and not engine_dead:  # a request the engine refused
        return bad_request(str(error))
    if engine_dead:
        return engine_failed(error)
    return APIError(500, f"The request failed in the engine: {type(error).__name__}: {error}",
                    error_type="server_error", code="internal_error")


def validation_param(loc: tuple[int | str, ...]) -> str | None:
    """Pydantic's error location as a dotted parameter name: ("messages", 0, "content") ->
    "messages[0].content"; the leading "body" FastAPI adds is dropped."""
    parts = [p for p in loc if p != "body"]
    name = ""
    for part in parts:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not name:
            name = part
        elif not _is_union_tag(part):
            name += f".{part}"
    return name or None


def _is_union_tag(part: str) -> bool:
    # Pydantic names the union branch it tried ("str", "list[int]", "function-after[...]").
    return part in ("str", "int", "float", "bool", "dict", "none") or "[" in part


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_client_gone(_: Request, __: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = validation_param(tuple(first.get("loc", ())))
        return bad_request(f"{param or 'request'}: {first.get('msg')}", param).response()

    async def on_http_exception(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = "Not found: no such route. See /docs for the API."
        elif exc.status_code == 405:
            message = "Method not allowed on this route."
        else:
            message = str(exc.detail)
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(message, error_type), status_code=exc.status_code,
                            headers=dict(exc.headers or {}))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ClientDisconnected, on_client_gone)
    app.add_exception_handler(ClientDisconnect, on_client_gone)  # starlette's: gone while its body was read
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_middleware(UnexpectedErrorMiddleware)


class UnexpectedErrorMiddleware:
    """Answers an exception that no handler took (a server bug) with OpenAI's error body and a
    500, itself. Left to Starlette's outermost middleware, the 500 would be sent and the error
    re-raised to uvicorn, which then closes the connection: one failed request would break the
    client's keep-alive connection for the next. Mid-response nothing can be answered any more,
    so there the error goes on up, and closing the connection is what tells the client."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            response = JSONResponse(error_body(f"Internal server error: {type(exc).__name__}: {exc}", "server_error",
                                               code="internal_error"), status_code=500)
            await response(scope, receive, send)
