"""The one path from admitted jobs to an HTTP answer, shared by every generation endpoint
(/v1/completions, /v1/chat/completions, /v1/responses, /v1/messages): stream the engine's deltas
as server-sent events, or collect them into one JSON response. What differs between the
endpoints lives in one `EventShape` per endpoint: its events and its whole object. OpenAI's
chunk streams (completions, chat) share their framing (`data: [DONE]`, the usage chunk) here,
around a small `ResponseFormatter` per endpoint (object shapes, echo, the role chunk, the two
logprobs formats).

    engine deltas ──► generate_all ──► OutputAccumulator per job ──┬─► shape.events   (stream)
                                                                    └─► shape.response (collect)

A choice's index in the response is job_index * n + completion index, so a batched completions
request numbers its choices prompt by prompt, as OpenAI does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvserve.engine import CompletionOutput, OutputAccumulator, RequestOutput, TokenLogprobs
from kvserve.server.disconnect import unless_disconnected
from kvserve.server.engine_protocol import ServingEngine
from kvserve.server.errors import APIError, ClientDisconnected, check_model, error_from_engine
from kvserve.server.formatting import usage_of
from kvserve.server.ignored_fields import note_ignored_fields
from kvserve.server.generation import GenerationJob, generate_all
from kvserve.server.protocol import PromptTokensDetails, SamplingFields, Usage
from kvserve.server.request_body import parse_body, read_json_body
from kvserve.server.sampling import reject_unsupported_fields
from kvserve.server.serving_state import Admission, ServingState
from kvserve.server.streaming import DONE_EVENT, EventStreamResponse, sse_event

BodyT = TypeVar("BodyT", bound=SamplingFields)


@dataclass(frozen=True)
class Choice:
    """One completion as the response numbers it: a stream delta, or the whole collected output."""

    index: int
    job: GenerationJob
    output: CompletionOutput
    # The whole prompt's logprobs when the request asked for them (first entry None).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class ResponseFormatter(Protocol):
    def opening_chunks(self) -> list[BaseModel]:
        """Chunks a stream starts with, before any generated text."""

    def chunks(self, choice: Choice) -> list[BaseModel]:
        """The stream chunks for a completion's delta (none while its text is held back)."""

    def chunk_events(self, choice: Choice) -> list[str]:
        """`[sse_event(c) for c in chunks(choice)]`, byte for byte, by a cheaper path where there is one."""

    def usage_chunk(self, usage: Usage) -> BaseModel:
        """The stream's last chunk when the client asked for usage."""

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel:
        """The whole non-streaming response; `choices` are in index order."""


class EventShape(Protocol):
    """One API's answer: the events of its stream, and its whole object."""

    def opening_events(self) -> list[str]:
        """Events a stream starts with, before any generated text."""

    def delta_events(self, choice: Choice) -> list[str]:
        """The events for a completion's delta (none while its text is held back)."""

    def closing_events(self, usage: Usage) -> list[str]:
        """Events after the last delta."""

    def failure_events(self, error: APIError) -> list[str]:
        """Events that end a stream that failed after its first byte."""

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel:
        """The whole non-streaming response; `choices` are in index order."""


class _ChunkStream:
    """OpenAI's chunk streams: the formatter's chunks as `data:` events, the usage chunk when
    asked for (on every chunk with continuous_usage_stats), `data: [DONE]` at the end."""

    def __init__(self, formatter: ResponseFormatter, body: SamplingFields, run: _Run) -> None:
        self.formatter = formatter
        self.include_usage = body.include_usage
        self.continuous_usage = body.continuous_usage_stats
        self.run = run

    def opening_events(self) -> list[str]:
        return [sse_event(chunk) for chunk in self.formatter.opening_chunks()]

    def delta_events(self, choice: Choice) -> list[str]:
        if self.continuous_usage:
            return [sse_event(chunk.model_copy(update={"usage": self.run.usage_so_far()}))
                    for chunk in self.formatter.chunks(choice)]
        return self.formatter.chunk_events(choice)

    def closing_events(self, usage: Usage) -> list[str]:
        return ([sse_event(self.formatter.usage_chunk(usage))] if self.include_usage else []) + [DONE_EVENT]

    def failure_events(self, error: APIError) -> list[str]:
        return [sse_event(error.body()), DONE_EVENT]

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel:
        return self.formatter.response(choices, usage)


async def read_generation_request(request: Request, state: ServingState, body_type: type[BodyT]
                                  ) -> tuple[BodyT, ServingEngine]:
    """Parses the body and checks what every generation endpoint checks before its own fields."""
    body = parse_body(body_type, await read_json_body(request, state.settings.limits.max_body_bytes))
    engine = state.ready_engine()
    check_model(body.model, engine.config.model_name)
    reject_unsupported_fields(body)
    note_ignored_fields(request, body)
    return body, engine


async def respond(request: Request, state: ServingState, engine: ServingEngine, jobs: Sequence[GenerationJob],
                  body: SamplingFields, formatter: ResponseFormatter) -> Response:
    """Admits the jobs' sequences and answers as an OpenAI chunk stream or as one response."""
    run = _Run(engine, jobs, body.n, state.abort_all)
    return await _answer(request, state, run, body.stream, _ChunkStream(formatter, body, run))


async def respond_with_events(request: Request, state: ServingState, engine: ServingEngine,
                              jobs: Sequence[GenerationJob], n: int, stream: bool, shape: EventShape) -> Response:
    """Admits the jobs' sequences and answers as `shape`'s event stream or whole object."""
    return await _answer(request, state, _Run(engine, jobs, n, state.abort_all), stream, shape)


async def _answer(request: Request, state: ServingState, run: _Run, stream: bool, shape: EventShape) -> Response:
    admission = state.admit(len(run.jobs) * run.n)
    run.formatter = shape
    if stream:
        return EventStreamResponse(run.stream(), on_close=admission.release)
    return await _collect(request, run, admission)


async def _collect(request: Request, run: _Run, admission: Admission) -> Response:
    try:
        await unless_disconnected(request, run.drain())
    except ClientDisconnected:
        raise  # the client's doing, not a failure: answered 499 (errors.py), the engine aborted the work
    except Exception as error:
        raise error_from_engine(error, run.engine.is_dead) from error
    finally:
        admission.release()
    outputs = run.results()
    return JSONResponse(run.formatter.response(run.final_choices(outputs), usage_of(outputs)).model_dump())


class _Run:
    def __init__(self, engine: ServingEngine, jobs: Sequence[GenerationJob], n: int, abort_all: asyncio.Event) -> None:
        self.engine = engine
        self.jobs = jobs
        self.n = n
        self.formatter: EventShape | None = None  # set by _answer
        self.abort_all = abort_all
        self.accumulators = [OutputAccumulator() for _ in jobs]
        # Running totals for vLLM's continuous_usage_stats (usage on every chunk).
        self._completion_tokens = 0
        self._cached_tokens = [0] * len(jobs)

    async def deltas(self) -> AsyncGenerator[Choice, None]:
        """Each completion's news in arrival order, none after the completion has finished."""
        async with aclosing(generate_all(self.engine, self.jobs, self.abort_all)) as updates:
            async for update in updates:
                job = self.jobs[update.job_index]
                self._cached_tokens[update.job_index] = update.output.num_cached_tokens
                for completion in self.accumulators[update.job_index].add(update.output):
                    self._completion_tokens += len(completion.token_ids)
                    yield Choice(update.job_index * self.n + completion.index, job, completion,
                                 update.output.prompt_logprobs)

    async def drain(self) -> None:
        async with aclosing(self.deltas()) as deltas:
            async for _ in deltas:
                pass

    def results(self) -> list[RequestOutput]:
        return [accumulator.result() for accumulator in self.accumulators]

    def final_choices(self, outputs: list[RequestOutput]) -> list[Choice]:
        choices = [Choice(job_index * self.n + c.index, self.jobs[job_index], c, output.prompt_logprobs)
                   for job_index, output in enumerate(outputs) for c in output.outputs]
        return sorted(choices, key=lambda choice: choice.index)

    def usage_so_far(self) -> Usage:
        prompt_tokens = sum(len(job.prompt_token_ids) for job in self.jobs)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=self._completion_tokens,
                     total_tokens=prompt_tokens + self._completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._cached_tokens)))

    async def stream(self) -> AsyncGenerator[str, None]:
        shape = self.formatter
        assert shape is not None
        for event in shape.opening_events():
            yield event
        try:
            async with aclosing(self.deltas()) as deltas:
                async for choice in deltas:
                    delta = choice.output
                    # A token whose text is still held back (a possible stop string, a partial
                    # character) makes no event unless it carries logprobs.
                    if delta.text or delta.logprobs or delta.finished:
                        for event in shape.delta_events(choice):
                            yield event
        except Exception as error:  # after the first byte, an error can only be an event
            for event in shape.failure_events(error_from_engine(error, self.engine.is_dead)):
                yield event
            return
        for event in shape.closing_events(usage_of(self.results())):
            yield event
