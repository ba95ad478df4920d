"""Anthropic's Messages API over the chat path: POST /v1/messages (translated into a chat
request, served by the same generation core, answered as a Message or its event stream) and
POST /v1/messages/count_tokens. Every error on these routes has Anthropic's shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from kvserve.server.anthropic_output import MessagesShape, error_response
from kvserve.server.anthropic_request import CHAT_FIELD_NAMES, CountTokensRequest, MessagesRequest, translate
from kvserve.server.chat import chat_prompt, plan_chat
from kvserve.server.errors import APIError, check_model
from kvserve.server.ignored_fields import note_ignored
from kvserve.server.request_body import parse_body, read_json_body
from kvserve.server.responder import respond_with_events
from kvserve.server.responses_output import new_item_id
from kvserve.server.serving_state import ServingState
from kvserve.server.translation import fields_named


class AnthropicErrorsRoute(APIRoute):
    """Answers this route's APIErrors (its own checks' and the chat path's) in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as error:
                return error_response(error)

        return handle


def messages_router(state: ServingState) -> APIRouter:
    router = APIRouter(route_class=AnthropicErrorsRoute)

    async def read(request: Request, body_type: type[MessagesRequest]) -> MessagesRequest:
        body = parse_body(body_type, await read_json_body(request, state.settings.limits.max_body_bytes))
        check_model(body.model, state.ready_engine().config.model_name)
        return body

    @router.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        body = await read(request, MessagesRequest)
        engine = state.ready_engine()
        translated = translate(body, state.settings.limits.max_tokens)
        note_ignored(request, body.unknown_fields() + translated.ignored)
        message_id = new_item_id("msg")
        with fields_named(CHAT_FIELD_NAMES):
            plan = await plan_chat(state, engine, translated.chat, message_id)
        shape = MessagesShape(message_id, engine.config.model_name, plan.answer, len(plan.job.prompt_token_ids),
                              body.stop_sequences or [])
        return await respond_with_events(request, state, engine, [plan.job], 1, body.stream, shape)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        body = await read(request, CountTokensRequest)
        translated = translate(body, state.settings.limits.max_tokens)
        note_ignored(request, body.unknown_fields() + translated.ignored)
        with fields_named(CHAT_FIELD_NAMES):
            prompt = chat_prompt(state, state.ready_engine(), translated.chat)
        return JSONResponse({"input_tokens": len(prompt.token_ids)})

    return router
