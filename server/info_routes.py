"""The small routes: /v1/models, /health, /version, /tokenize, /detokenize, /metrics."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.server.errors import bad_request, check_model
from kvserve.server.http_metrics import HttpMetrics
from kvserve.server.prompts import chat_messages
from kvserve.server.protocol import DetokenizeRequest, TokenizeRequest, now_s
from kvserve.server.request_body import parse_body, read_json_body
from kvserve.server.serving_state import Phase, ServingState


def kvserve_version() -> str:
    try:
        return version("kvserve")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def models_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        engine = state.ready_engine()
        config = engine.config
        card = {"id": config.model_name, "object": "model", "created": now_s(), "owned_by": "kvserve",
                "root": config.model, "parent": None, "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    return router


def operations_router(state: ServingState, metrics: HttpMetrics | None) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        """200 only when this replica should get traffic: load balancers route on it."""
        engine = state.engine
        if state.phase is Phase.LOADING or engine is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers=_retry(state))
        if engine.is_dead:
            return JSONResponse({"status": "dead", "error": str(engine.dead_error)}, status_code=503)
        if state.phase is Phase.DRAINING:
            return JSONResponse({"status": "draining"}, status_code=503, headers=_retry(state))
        return JSONResponse({"status": "ok"})

    @router.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": kvserve_version()}

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse_body(TokenizeRequest, await read_json_body(request, state.settings.limits.max_body_bytes))
        engine = state.ready_engine()
        check_model(body.model, engine.config.model_name)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of 'prompt' or 'messages'.", "prompt")
        if body.prompt is not None:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            try:
                text = engine.tokenizer.apply_chat_template(chat_messages(body.messages or []),
                                                            add_generation_prompt=body.add_generation_prompt)
            except ValueError as error:
                raise bad_request(f"The messages could not be formatted: {error}", "messages") from None
            tokens = engine.tokenizer.encode(text, add_special_tokens=False)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse_body(DetokenizeRequest, await read_json_body(request, state.settings.limits.max_body_bytes))
        engine = state.ready_engine()
        check_model(body.model, engine.config.model_name)
        bad = next((t for t in body.tokens if not 0 <= t < engine.tokenizer.vocab_size), None)
        if bad is not None:  # the tokenizer's vocabulary: this route only decodes
            raise bad_request(f"Token id {bad} is outside the vocabulary [0, {engine.tokenizer.vocab_size}).", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    if metrics is not None:
        exporter = metrics

        @router.get("/metrics")
        async def prometheus_metrics() -> Response:
            # Gauges are read from the engine now, not left at the last step's values.
            if state.engine is not None:
                exporter.observe_load(state.engine.load)
            body, content_type = exporter.render()
            return Response(body, media_type=content_type)

    return router


def _retry(state: ServingState) -> dict[str, str]:
    return {"Retry-After": str(state.settings.retry_after_s)}
