"""POST /v1/completions: validate everything, admit, then answer at once or as a stream."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvserve.server.engine_protocol import ServingTokenizer
from kvserve.server.errors import bad_request
from kvserve.server.formatting import completion_logprobs
from kvserve.server.generation import GenerationJob
from kvserve.server.prompts import completion_prompts, resolve_max_tokens
from kvserve.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage, new_id, now_s
from kvserve.server.responder import Choice, read_generation_request, respond
from kvserve.server.sampling import build_sampling_params, with_max_tokens
from kvserve.server.serving_state import ServingState


def completions_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        limits = state.settings.limits
        body, engine = await read_generation_request(request, state, CompletionRequest)
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
        formatter = _CompletionFormatter(body, engine.tokenizer, jobs, response_id, now_s(),
                                         engine.config.model_name)
        return await respond(request, state, engine, jobs, body, formatter)

    return router


class _CompletionFormatter:
    """Completion objects, and chunks that open with the echoed prompts when asked to."""

    def __init__(self, body: CompletionRequest, tokenizer: ServingTokenizer, jobs: list[GenerationJob],
                 response_id: str, created: int, model: str) -> None:
        self.body = body
        self.tokenizer = tokenizer
        self.jobs = jobs
        self.header = {"id": response_id, "created": created, "model": model}
        self._text_offset: dict[int, int] = {}  # per streamed choice: characters sent so far

    def _with(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(**self.header, choices=choices, usage=usage)

    def opening_chunks(self) -> list[BaseModel]:
        if not self.body.echo:
            return []
        return [self._with([CompletionChoice(index=job_index * self.body.n + c, text=job.prompt_text)])
                for job_index, job in enumerate(self.jobs) for c in range(self.body.n)]

    def chunk(self, choice: Choice) -> BaseModel:
        delta = choice.output
        logprobs = None
        if self.body.logprobs is not None:
            offset = self._text_offset.get(choice.index, 0)
            logprobs = completion_logprobs(delta.logprobs or [], self.tokenizer, offset, self.body.logprobs)
            self._text_offset[choice.index] = offset + sum(len(t) for t in logprobs.tokens)
        return self._with([CompletionChoice(index=choice.index, text=delta.text, logprobs=logprobs,
                                            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._with([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel:
        rendered = []
        for choice in choices:
            completion = choice.output
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = completion_logprobs(completion.logprobs or [], self.tokenizer, 0, self.body.logprobs)
            echo = choice.job.prompt_text if self.body.echo else ""
            rendered.append(CompletionChoice(index=choice.index, text=echo + completion.text, logprobs=logprobs,
                                             finish_reason=completion.finish_reason,
                                             stop_reason=completion.stop_reason))
        return self._with(rendered, usage)
