"""POST /v1/chat/completions: messages through the model's chat template, then the same
generation path as completions, rendered as chat objects or chat stream chunks. `plan_chat` is
the chat path the Responses and Messages endpoints take too (their requests translated into a
chat request); with a reasoning parser, the reasoning is `message.reasoning` (and
`reasoning_content`, which many clients read), streamed as `delta.reasoning`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvserve.engine import CompletionOutput
from kvserve.server.answer import AnswerFormat, AnswerStream, whole_answer
from kvserve.server.engine_protocol import ServingEngine, ServingTokenizer
from kvserve.server.errors import bad_request
from kvserve.server.formatting import chat_logprobs
from kvserve.server.generation import GenerationJob
from kvserve.server.prompts import admit, chat_messages, resolve_max_tokens
from kvserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, Usage, new_id,
                                     now_s)
from kvserve.server.reasoning_grammar import after_reasoning
from kvserve.server.responder import Choice, read_generation_request, respond
from kvserve.server.sampling import build_sampling_params, with_max_tokens
from kvserve.server.serving_state import ServingState
from kvserve.server.streaming import sse_event
from kvserve.server.structured_outputs import output_constraint
from kvserve.server.tool_calls import FunctionCall, ToolCall, ToolMode, template_tools, tool_mode


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt as the model sees it."""

    text: str
    token_ids: list[int]
    tools: ToolMode | None


@dataclass(frozen=True)
class ChatPlan:
    """An admitted chat request: its job, and how its output is to be read."""

    job: GenerationJob
    answer: AnswerFormat
    top_logprobs: int | None


def chat_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body, engine = await read_generation_request(request, state, ChatCompletionRequest)
        response_id = new_id("chatcmpl")
        plan = await plan_chat(state, engine, body, response_id)
        formatter = _ChatFormatter(body.n, plan.top_logprobs, engine.tokenizer, response_id, now_s(),
                                   engine.config.model_name, plan.answer)
        return await respond(request, state, engine, [plan.job], body, formatter)

    return router


def chat_prompt(state: ServingState, engine: ServingEngine, body: ChatCompletionRequest) -> ChatPrompt:
    """The messages (and the tools the request's mode shows the model) through the chat template."""
    tools = tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls, state.settings.auto_tool_parser,
                      state.settings.new_tool_call_id)
    text = _render(engine, body, template_tools(body.tools, tools))
    return ChatPrompt(text, engine.tokenizer.encode(text, add_special_tokens=False), tools)


async def plan_chat(state: ServingState, engine: ServingEngine, body: ChatCompletionRequest, request_id: str) -> ChatPlan:
    """Everything a chat request is checked for, then its admission: the one chat path that the
    Responses and Messages endpoints take too, with their requests translated into this one."""
    limits = state.settings.limits
    top_logprobs = _top_logprobs(body)
    # max_completion_tokens replaced max_tokens in OpenAI's API; either may be sent.
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    base = build_sampling_params(body, max_tokens=requested, logprobs=top_logprobs,
                                 logprobs_param="top_logprobs", limits=limits)
    constraint = output_constraint(body)
    prompt = chat_prompt(state, engine, body)
    if prompt.tools is not None and prompt.tools.constraint is not None:
        if constraint is not None:
            raise bad_request("A forced tool call cannot be combined with another output constraint.",
                              constraint.param)
        constraint = prompt.tools.constraint
    style = state.settings.reasoning_style
    starts_open = style.starts_open(prompt.text) if style is not None else None
    if starts_open is not None and constraint is not None:
        constraint = after_reasoning(constraint, starts_open)
    renamed = {"max_tokens": param}
    if constraint is not None:
        base = replace(base, structured_output=constraint.params)
        renamed["structured_output"] = constraint.param
    params = with_max_tokens(base, resolve_max_tokens(len(prompt.token_ids), requested, engine.max_model_len, limits))
    await admit(engine, prompt.token_ids, params, priority=body.priority, cache_salt=body.cache_salt, renamed=renamed)
    job = GenerationJob(f"{request_id}-0", prompt.text, prompt.token_ids, params, body.priority, body.cache_salt)
    return ChatPlan(job, AnswerFormat(prompt.tools, starts_open), top_logprobs)


def _top_logprobs(body: ChatCompletionRequest) -> int | None:
    if not body.logprobs:
        if body.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        return None
    return body.top_logprobs or 0


def _render(engine: ServingEngine, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> str:
    try:
        return engine.tokenizer.apply_chat_template(chat_messages(body.messages),
                                                    add_generation_prompt=body.add_generation_prompt, tools=tools)
    except ValueError as error:  # ChatTemplateError and kin: the messages do not fit the template
        raise bad_request(f"The messages could not be formatted with the model's chat template: {error}",
                          "messages") from None


class _ChatFormatter:
    """Chat completion objects, and chunks that open with the assistant role for every choice."""

    def __init__(self, n: int, top_logprobs: int | None, tokenizer: ServingTokenizer, response_id: str,
                 created: int, model: str, answer: AnswerFormat) -> None:
        self.n = n
        self.answer = answer
        # Output is read (reasoning split off, calls parsed) only when there is something to read.
        self._reads = answer.tools is not None or answer.reasoning_starts_open is not None
        self._streams: dict[int, AnswerStream] = {}  # per streamed choice
        self.top_logprobs = top_logprobs
        self.tokenizer = tokenizer
        self.header = {"id": response_id, "created": created, "model": model}

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.header, choices=choices, usage=usage)

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})])
                for index in range(self.n)]

    def chunks(self, choice: Choice) -> list[BaseModel]:
        delta = choice.output
        if self._reads:
            return self._answer_chunks(choice)
        return [self._chunk([ChatChunkChoice(index=choice.index, delta={"content": delta.text} if delta.text else {},
                                             logprobs=self._logprobs(delta), finish_reason=delta.finish_reason,
                                             stop_reason=delta.stop_reason)])]

    def _answer_chunks(self, choice: Choice) -> list[BaseModel]:
        """Reasoning and content as they are decided, then per call a chunk with its id and name
        and chunks with its argument fragments as they are generated. The delta's logprobs ride
        on the first chunk, the finish reason on the last; a delta whose text is all held back
        makes a chunk only when it carries one of those."""
        output = choice.output
        stream = self._streams.setdefault(choice.index, AnswerStream(self.answer))
        update = stream.feed(output.text, final=output.finished)
        if output.finished:
            del self._streams[choice.index]
        deltas: list[dict] = [{"reasoning": update.reasoning, "reasoning_content": update.reasoning}] \
            if update.reasoning else []
        deltas += [{"content": update.content}] if update.content else []
        deltas += [{"tool_calls": [call]} for call in update.tool_calls]
        logprobs = self._logprobs(output)
        if not deltas and (logprobs is not None and logprobs.content or output.finished):
            deltas = [{}]
        finish = "tool_calls" if update.has_calls else output.finish_reason
        last = len(deltas) - 1
        return [self._chunk([ChatChunkChoice(
            index=choice.index, delta=d, logprobs=logprobs if i == 0 else None,
            finish_reason=finish if i == last else None,
            stop_reason=output.stop_reason if i == last and not update.has_calls else None)])
            for i, d in enumerate(deltas)]

    def chunk_events(self, choice: Choice) -> list[str]:
        return [sse_event(chunk) for chunk in self.chunks(choice)]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel:
        return ChatCompletionResponse(**self.header, usage=usage, choices=[self._choice(c) for c in choices])

    def _choice(self, choice: Choice) -> ChatChoice:
        output = choice.output
        if not self._reads:
            return ChatChoice(index=choice.index, message=AssistantMessage(content=output.text),
                              logprobs=self._logprobs(output), finish_reason=output.finish_reason,
                              stop_reason=output.stop_reason)
        answer = whole_answer(self.answer, output.text)
        # As OpenAI: a reply that only calls tools (or, as vLLM, only reasons) has null content.
        content = answer.content if answer.content or not (answer.calls or answer.reasoning) else None
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in answer.calls]
        message = AssistantMessage(content=content, tool_calls=calls, reasoning=answer.reasoning,
                                   reasoning_content=answer.reasoning)
        if calls:
            return ChatChoice(index=choice.index, message=message, logprobs=self._logprobs(output),
                              finish_reason="tool_calls")
        return ChatChoice(index=choice.index, message=message, logprobs=self._logprobs(output),
                          finish_reason=output.finish_reason, stop_reason=output.stop_reason)

    def _logprobs(self, completion: CompletionOutput) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(completion.logprobs or [], self.tokenizer, self.top_logprobs)
