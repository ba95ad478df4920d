"""POST /v1/completions: validate everything, admit, then answer at once or as a stream."""

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
from kvserve.server.formatting import completion_logprobs, usage_of
from kvserve.server.generation import GenerationJob, collect_final, generate_all
from kvserve.server.prompts import completion_prompts, resolve_max_tokens
from kvserve.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, new_id, now_s
from kvserve.server.request_body import parse_body, read_json_body
from kvserve.server.sampling import build_sampling_params, reject_unsupported_fields, with_max_tokens
from kvserve.server.serving_state import ServingState
from kvserve.server.streaming import DONE_EVENT, EventStreamResponse, sse_event


def completions_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        limits = state.settings.limits
        body = parse_body(CompletionRequest, await read_json_body(request, limits.max_body_bytes))
        engine = state.ready_engine()
        check_model(body.model, engine.config.model_name)
        reject_unsupported_fields(body)
        note_ignored_fields(request, body)
        if body.echo and body.logprobs is not None:
            raise bad_request("echo together with logprobs would need prompt logprobs, which this server does "
                              "not compute; drop one of them.", "echo")
        base = build_sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                     logprobs_param="logprobs", limits=limits)
        prompts = completion_prompts(body.prompt, engine.tokenizer, limits)
        response_id = new_id("cmpl")
        jobs = [
            GenerationJob(f"{response_id}-{i}", p.text, p.token_ids,
                          with_max_tokens(base, resolve_max_tokens(len(p.token_ids), body.max_tokens,
                                                                   engine.max_model_len, limits)))
            for i, p in enumerate(prompts)
        ]
        admission = state.admit(len(jobs) * body.n)
        view = _CompletionView(engine, body, response_id, now_s(), engine.config.model_name, jobs)
        if body.stream:
            return EventStreamResponse(view.stream(state.abort_all), on_close=admission.release)
        try:
            outputs = await unless_disconnected(request, collect_final(engine, jobs, state.abort_all))
        except Exception as error:
            raise error_from_engine(error, engine.is_dead) from error
        finally:
            admission.release()
        return JSONResponse(view.response(outputs).model_dump())

    return router


class _CompletionView:
    """Renders one request's engine outputs as OpenAI completion objects or stream chunks."""

    def __init__(self, engine: ServingEngine, body: CompletionRequest, response_id: str, created: int,
                 model: str, jobs: list[GenerationJob]) -> None:
        self.engine = engine
        self.body = body
        self.response_id = response_id
        self.created = created
        self.model = model
        self.jobs = jobs

    def _choice_index(self, job_index: int, completion_index: int) -> int:
        return job_index * self.body.n + completion_index

    def _echo(self, job_index: int) -> str:
        return self.jobs[job_index].prompt_text if self.body.echo else ""

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for job_index, output in enumerate(outputs):
            for completion in output.outputs:
                logprobs = None
                if self.body.logprobs is not None:
                    logprobs = completion_logprobs(completion.logprobs or [], self.engine.tokenizer, 0,
                                                   self.body.logprobs)
                choices.append(CompletionChoice(
                    index=self._choice_index(job_index, completion.index),
                    text=self._echo(job_index) + completion.text, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage_of(outputs))

    def _chunk(self, choice: CompletionChoice) -> str:
        return sse_event(CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                            choices=[choice]))

    async def stream(self, abort_all: asyncio.Event) -> AsyncGenerator[str, None]:
        sent_chars: dict[int, int] = {}
        sent_logprobs: dict[int, int] = {}
        text_offset: dict[int, int] = {}
        done: set[int] = set()
        latest: dict[int, RequestOutput] = {}
        if self.body.echo:
            for job_index, job in enumerate(self.jobs):
                for c in range(self.body.n):
                    yield self._chunk(CompletionChoice(index=self._choice_index(job_index, c), text=job.prompt_text))
        try:
            async with aclosing(generate_all(self.engine, self.jobs, abort_all)) as updates:
                async for update in updates:
                    latest[update.job_index] = update.output
                    for completion in update.output.outputs:
                        index = self._choice_index(update.job_index, completion.index)
                        if index in done:
                            continue
                        delta = completion.text[sent_chars.get(index, 0):]
                        entries = (completion.logprobs or [])[sent_logprobs.get(index, 0):]
                        if not delta and not entries and completion.finish_reason is None:
                            continue
                        logprobs = None
                        if self.body.logprobs is not None:
                            logprobs = completion_logprobs(entries, self.engine.tokenizer,
                                                           text_offset.get(index, 0), self.body.logprobs)
                            text_offset[index] = text_offset.get(index, 0) + sum(len(t) for t in logprobs.tokens)
                        sent_chars[index] = len(completion.text)
                        sent_logprobs[index] = len(completion.logprobs or [])
                        if completion.finish_reason is not None:
                            done.add(index)
                        yield self._chunk(CompletionChoice(index=index, text=delta, logprobs=logprobs,
                                                           finish_reason=completion.finish_reason,
                                                           stop_reason=completion.stop_reason))
        except Exception as error:  # after the first byte, an error can only be an event
            yield sse_event(error_from_engine(error, self.engine.is_dead).body())
            yield DONE_EVENT
            return
        if self.body.include_usage:
            usage = usage_of([latest[i] for i in sorted(latest)])
            yield sse_event(CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                               choices=[], usage=usage))
        yield DONE_EVENT
