"""POST /v1/completions: validate everything, admit, then answer at once or as a stream.

Prompt scoring (what lm-eval's loglikelihood tasks send): `echo` + `logprobs` puts the prompt's
tokens and logprobs ahead of the generated ones; `max_tokens: 0` with `echo` returns the prompt
only. The engine always samples at least one token, so such a request runs with one and the
response leaves it out (usage then counts no completion tokens).
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvserve.engine import FinishReason
from kvserve.server.chunk_template import CompletionChunkTemplate
from kvserve.server.engine_protocol import ServingTokenizer
from kvserve.server.errors import bad_request
from kvserve.server.formatting import completion_logprobs
from kvserve.server.generation import GenerationJob
from kvserve.server.limits import ServerLimits
from kvserve.server.prompt_logprobs_format import echoed_completion_logprobs, vllm_prompt_logprobs
from kvserve.server.prompts import admit, completion_prompts, resolve_max_tokens
from kvserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                     Usage, new_id, now_s)
from kvserve.server.responder import Choice, read_generation_request, respond
from kvserve.server.sampling import build_sampling_params, with_max_tokens
from kvserve.server.serving_state import ServingState
from kvserve.server.streaming import sse_event
from kvserve.server.structured_outputs import output_constraint


def completions_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        limits = state.settings.limits
        body, engine = await read_generation_request(request, state, CompletionRequest)
        score_only = _check_scoring(body)
        max_tokens = 1 if score_only else body.max_tokens
        base = build_sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs,
                                     logprobs_param="logprobs", limits=limits)
        constraint = output_constraint(body)
        base = replace(base, prompt_logprobs=_prompt_logprobs(body, limits),
                       structured_output=constraint.params if constraint is not None else None)
        renamed = {"structured_output": constraint.param} if constraint is not None else None
        prompts = completion_prompts(body.prompt, engine.tokenizer, limits)
        response_id = new_id("cmpl")
        jobs = []
        for i, p in enumerate(prompts):
            params = with_max_tokens(base, resolve_max_tokens(len(p.token_ids), max_tokens,
                                                              engine.max_model_len, limits))
            await admit(engine, p.token_ids, params, priority=body.priority, cache_salt=body.cache_salt, renamed=renamed)
            text = p.text if p.text is not None else engine.tokenizer.decode(p.token_ids, skip_special_tokens=False)
            jobs.append(GenerationJob(f"{response_id}-{i}", text, p.token_ids, params, body.priority, body.cache_salt))
        formatter = _CompletionFormatter(body, engine.tokenizer, jobs, response_id, now_s(),
                                         engine.config.model_name, score_only)
        return await respond(request, state, engine, jobs, body, formatter)

    return router


def _check_scoring(body: CompletionRequest) -> bool:
    """True when the request scores its prompt only (max_tokens 0)."""
    if body.max_tokens != 0:
        return False
    if not body.echo:
        raise bad_request("max_tokens must be at least 1, unless echo is true (then 0 scores the prompt only).",
                          "max_tokens")
    if body.stream:
        raise bad_request("max_tokens 0 (score the prompt only) cannot be streamed; set stream to false.",
                          "max_tokens")
    return True


def _prompt_logprobs(body: CompletionRequest, limits: ServerLimits) -> int | None:
    """How many alternatives to score each prompt token with, or None when the prompt is not scored."""
    wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    if body.prompt_logprobs is not None and not 0 <= body.prompt_logprobs <= limits.max_logprobs:
        raise bad_request(f"prompt_logprobs must be in [0, {limits.max_logprobs}], got {body.prompt_logprobs}",
                          "prompt_logprobs")
    return max(wanted) if wanted else None


class _CompletionFormatter:
    """Completion objects, and chunks that open with the echoed prompts when asked to."""

    def __init__(self, body: CompletionRequest, tokenizer: ServingTokenizer, jobs: list[GenerationJob],
                 response_id: str, created: int, model: str, score_only: bool) -> None:
        self.body = body
        self.tokenizer = tokenizer
        self.jobs = jobs
        self.header = {"id": response_id, "created": created, "model": model}
        self.score_only = score_only
        # With echo + logprobs the prompt's text travels with its logprobs, which exist only once
        # the prompt has been through the model: in the choice's first chunk, not an opening one.
        self.echo_with_logprobs = body.echo and body.logprobs is not None
        self._text_offset: dict[int, int] = {}  # per streamed choice: characters sent so far
        # Chunks that carry text only (no logprobs of any kind) skip pydantic: one per token.
        self._plain = CompletionChunkTemplate(response_id, created, model) \
            if body.logprobs is None and body.prompt_logprobs is None else None

    def _with(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(**self.header, choices=choices, usage=usage)

    def opening_chunks(self) -> list[BaseModel]:
        if not self.body.echo or self.echo_with_logprobs:
            return []
        return [self._with([CompletionChoice(index=job_index * self.body.n + c, text=job.prompt_text)])
                for job_index, job in enumerate(self.jobs) for c in range(self.body.n)]

    def _logprobs(self, choice: Choice, generated: list, offset: int, first: bool) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        if first and self.echo_with_logprobs:
            return echoed_completion_logprobs(choice.job.prompt_token_ids, choice.prompt_logprobs or [None],
                                              generated, self.tokenizer, self.body.logprobs)
        return completion_logprobs(generated, self.tokenizer, offset, self.body.logprobs)

    def _prompt_logprobs(self, choice: Choice, first: bool) -> list | None:
        if self.body.prompt_logprobs is None or not first or choice.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(choice.prompt_logprobs, self.tokenizer, self.body.prompt_logprobs)

    def chunks(self, choice: Choice) -> list[BaseModel]:
        delta = choice.output
        first = choice.index not in self._text_offset
        offset = self._text_offset.get(choice.index, 0)
        logprobs = self._logprobs(choice, delta.logprobs or [], offset, first)
        if logprobs is not None:
            self._text_offset[choice.index] = offset + sum(len(t) for t in logprobs.tokens)
        else:
            self._text_offset.setdefault(choice.index, 0)
        text = choice.job.prompt_text + delta.text if first and self.echo_with_logprobs else delta.text
        return [self._with([CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                             finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                             prompt_logprobs=self._prompt_logprobs(choice, first))])]

    def chunk_events(self, choice: Choice) -> list[str]:
        if self._plain is None:
            return [sse_event(chunk) for chunk in self.chunks(choice)]
        delta = choice.output
        return [self._plain.event(choice.index, delta.text, delta.finish_reason, delta.stop_reason)]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._with([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel:
        rendered = []
        for choice in choices:
            completion = choice.output
            generated = [] if self.score_only else completion.logprobs or []
            echo = choice.job.prompt_text if self.body.echo else ""
            rendered.append(CompletionChoice(
                index=choice.index, text=echo + ("" if self.score_only else completion.text),
                logprobs=self._logprobs(choice, generated, 0, first=True),
                finish_reason=FinishReason.LENGTH if self.score_only else completion.finish_reason,
                stop_reason=None if self.score_only else completion.stop_reason,
                prompt_logprobs=self._prompt_logprobs(choice, first=True)))
        if self.score_only:
            usage = usage.model_copy(update={"completion_tokens": 0, "total_tokens": usage.prompt_tokens})
        return self._with(rendered, usage)
