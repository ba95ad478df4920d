"""POST /v1/chat/completions: messages through the model's chat template, then the same
generation path as completions, rendered as chat objects or chat stream chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.outputs import RequestOutput
from kvserve.server.disconnect import unless_disconnected
from kvserve.server.engine_protocol import ServingEngine
from kvserve.server.ignored_fields import note_ignored_fields
from kvserve.server.errors import bad_request, check_model, error_from_engine
from kvserve.server.formatting import chat_logprobs, usage_of
from kvserve.server.generation import GenerationJob, collect_final, generate_all
from kvserve.server.prompts import chat_messages, resolve_max_tokens
from kvserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, new_id, now_s)
from kvserve.server.request_body import parse_body, read_json_body
from kvserve.server.sampling import build_sampling_params, reject_unsupported_fields, with_max_tokens
from kvserve.server.serving_state import ServingState
from kvserve.server.streaming import DONE_EVENT, EventStreamResponse, sse_event


def chat_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        limits = state.settings.limits
        body = parse_body(ChatCompletionRequest, await read_json_body(request, limits.max_body_bytes))
        engine = state.ready_engine()
        check_model(body.model, engine.config.model_name)
        reject_unsupported_fields(body)
        note_ignored_fields(request, body)
        top_logprobs = _top_logprobs(body)
        # max_completion_tokens replaced max_tokens in OpenAI's API; either may be sent.
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        base = build_sampling_params(body, max_tokens=requested, logprobs=top_logprobs,
                                     logprobs_param="top_logprobs", limits=limits)
        prompt_text = _render(engine, body)
        token_ids = engine.tokenizer.encode(prompt_text, add_special_tokens=False)
        max_tokens = resolve_max_tokens(len(token_ids), requested, engine.max_model_len, limits, param)
        response_id = new_id("chatcmpl")
        jobs = [GenerationJob(f"{response_id}-0", prompt_text, token_ids, with_max_tokens(base, max_tokens))]
        admission = state.admit(body.n)
        view = _ChatView(engine, body, top_logprobs, response_id, now_s(), engine.config.model_name, jobs)
        if body.stream:
            return EventStreamResponse(view.stream(state.abort_all), on_close=admission.release)
        try:
            outputs = await unless_disconnected(request, collect_final(engine, jobs, state.abort_all))
        except Exception as error:
            raise error_from_engine(error, engine.is_dead) from error
        finally:
            admission.release()
        return JSONResponse(view.response(outputs[0]).model_dump())

    return router


def _top_logprobs(body: ChatCompletionRequest) -> int | None:
    if not body.logprobs:
        if body.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        return None
    return body.top_logprobs or 0


def _render(engine: ServingEngine, body: ChatCompletionRequest) -> str:
    try:
        return engine.tokenizer.apply_chat_template(chat_messages(body.messages),
                                                    add_generation_prompt=body.add_generation_prompt)
    except ValueError as error:  # ChatTemplateError and kin: the messages do not fit the template
        raise bad_request(f"The messages could not be formatted with the model's chat template: {error}",
                          "messages") from None


class _ChatView:
    def __init__(self, engine: ServingEngine, body: ChatCompletionRequest, top_logprobs: int | None,
                 response_id: str, created: int, model: str, jobs: list[GenerationJob]) -> None:
        self.engine = engine
        self.body = body
        self.top_logprobs = top_logprobs
        self.response_id = response_id
        self.created = created
        self.model = model
        self.jobs = jobs

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for completion in output.outputs:
            logprobs = None
            if self.top_logprobs is not None:
                logprobs = chat_logprobs(completion.logprobs or [], self.engine.tokenizer, self.top_logprobs)
            choices.append(ChatChoice(index=completion.index, message=AssistantMessage(content=completion.text),
                                      logprobs=logprobs, finish_reason=completion.finish_reason,
                                      stop_reason=completion.stop_reason))
        choices.sort(key=lambda c: c.index)
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=choices, usage=usage_of([output]))

    def _chunk(self, choice: ChatChunkChoice) -> str:
        return sse_event(ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                             choices=[choice]))

    async def stream(self, abort_all: asyncio.Event) -> AsyncGenerator[str, None]:
        sent_chars: dict[int, int] = {}
        sent_logprobs: dict[int, int] = {}
        done: set[int] = set()
        latest: RequestOutput | None = None
        for index in range(self.body.n):
            yield self._chunk(ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""}))
        try:
            async with aclosing(generate_all(self.engine, self.jobs, abort_all)) as updates:
                async for update in updates:
                    latest = update.output
                    for completion in update.output.outputs:
                        index = completion.index
                        if index in done:
                            continue
                        delta = completion.text[sent_chars.get(index, 0):]
                        entries = (completion.logprobs or [])[sent_logprobs.get(index, 0):]
                        if not delta and not entries and completion.finish_reason is None:
                            continue
                        logprobs = None
                        if self.top_logprobs is not None:
                            logprobs = chat_logprobs(entries, self.engine.tokenizer, self.top_logprobs)
                        sent_chars[index] = len(completion.text)
                        sent_logprobs[index] = len(completion.logprobs or [])
                        if completion.finish_reason is not None:
                            done.add(index)
                        yield self._chunk(ChatChunkChoice(index=index, delta={"content": delta} if delta else {},
                                                          logprobs=logprobs, finish_reason=completion.finish_reason,
                                                          stop_reason=completion.stop_reason))
        except Exception as error:  # after the first byte, an error can only be an event
            yield sse_event(error_from_engine(error, self.engine.is_dead).body())
            yield DONE_EVENT
            return
        if self.body.include_usage and latest is not None:
            yield sse_event(ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                                choices=[], usage=usage_of([latest])))
        yield DONE_EVENT
