"""OpenAI's Responses API over the chat path: POST /v1/responses (translated into a chat request,
served by the same generation core, answered as a Response or its event stream), POST
/v1/responses/input_tokens, and GET/DELETE /v1/responses/{id} for stored responses."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.server.chat import chat_prompt, plan_chat
from kvserve.server.errors import APIError, bad_request, check_model
from kvserve.server.ignored_fields import note_ignored
from kvserve.server.protocol import now_s
from kvserve.server.request_body import parse_body, read_json_body
from kvserve.server.responder import respond_with_events
from kvserve.server.responses_output import ResponsesOutput, ResponsesShape, new_item_id, response_header
from kvserve.server.responses_request import CHAT_FIELD_NAMES, ResponsesRequest, TranslatedRequest, translate
from kvserve.server.responses_store import ResponsesStore
from kvserve.server.serving_state import ServingState
from kvserve.server.translation import fields_named

STORE_OFF = ("The response store is off on this server (--no-enable-responses-store): responses are not kept, "
             "so send the whole conversation as input instead of previous_response_id.")


def responses_router(state: ServingState, store: ResponsesStore | None) -> APIRouter:
    """`store` None: the store is off."""
    router = APIRouter()

    async def read(request: Request) -> tuple[dict[str, Any], ResponsesRequest, TranslatedRequest]:
        raw = await read_json_body(request, state.settings.limits.max_body_bytes)
        body = parse_body(ResponsesRequest, raw)
        engine = state.ready_engine()
        check_model(body.model, engine.config.model_name)
        translated = translate(body, _earlier(store, body.previous_response_id))
        note_ignored(request, body.unknown_fields() + translated.ignored)
        return raw, body, translated

    @router.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        raw, body, translated = await read(request)
        engine = state.ready_engine()
        response_id = new_item_id("resp")
        with fields_named(CHAT_FIELD_NAMES):
            plan = await plan_chat(state, engine, translated.chat, response_id)
        keep = store is not None and body.store

        def on_finished(response: dict[str, Any], output: ResponsesOutput) -> None:
            if store is not None and keep:
                store.put(response, translated.conversation + [output.as_assistant_message()])

        header = response_header(response_id, now_s(), engine.config.model_name, raw, keep)
        shape = ResponsesShape(header, plan.answer, engine.tokenizer, on_finished)
        return await respond_with_events(request, state, engine, [plan.job], 1, body.stream, shape)

    @router.post("/v1/responses/input_tokens")
    async def count_input_tokens(request: Request) -> Response:
        _, _, translated = await read(request)
        with fields_named(CHAT_FIELD_NAMES):
            prompt = chat_prompt(state, state.ready_engine(), translated.chat)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt.token_ids)})

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        entry = _stored(store).get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return JSONResponse(entry.response)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        if not _stored(store).delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router


def _stored(store: ResponsesStore | None) -> ResponsesStore:
    if store is None:
        raise bad_request(STORE_OFF, "response_id")
    return store


def _earlier(store: ResponsesStore | None, previous_response_id: str | None) -> list[dict[str, Any]]:
    """The conversation a follow-up continues ([] for a new one)."""
    if previous_response_id is None:
        return []
    if store is None:
        raise bad_request(STORE_OFF, "previous_response_id")
    entry = store.get(previous_response_id)
    if entry is None:
        raise bad_request(f"Previous response with id {previous_response_id!r} not found (responses are kept in "
                          "memory, the least recently used dropped first, and not across restarts).",
                          "previous_response_id", code="previous_response_not_found")
    return [dict(message) for message in entry.conversation]


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", error_type="invalid_request_error",
                    param="response_id", code="not_found")
