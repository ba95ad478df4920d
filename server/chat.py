"""POST /v1/chat/completions: messages through the model's chat template, then the same
generation path as completions, rendered as chat objects or chat stream chunks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvserve.engine import CompletionOutput
from kvserve.server.engine_protocol import ServingEngine, ServingTokenizer
from kvserve.server.errors import bad_request
from kvserve.server.formatting import chat_logprobs
from kvserve.server.generation import GenerationJob
from kvserve.server.prompts import admit, chat_messages, resolve_max_tokens
from kvserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, Usage, new_id,
                                     now_s)
from kvserve.server.responder import Choice, read_generation_request, respond
from kvserve.server.sampling import build_sampling_params, with_max_tokens
from kvserve.server.serving_state import ServingState
from kvserve.server.tool_calls import ToolMode, template_tools, tool_calls_from_output, tool_mode


def chat_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        limits = state.settings.limits
        body, engine = await read_generation_request(request, state, ChatCompletionRequest)
        top_logprobs = _top_logprobs(body)
        # max_completion_tokens replaced max_tokens in OpenAI's API; either may be sent.
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        base = build_sampling_params(body, max_tokens=requested, logprobs=top_logprobs,
                                     logprobs_param="top_logprobs", limits=limits)
        tools = tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls)
        if tools is not None:
            if base.structured_output is not None:
                raise bad_request("A forced tool call cannot be combined with another output constraint.",
                                  base.structured_output.param)
            base = replace(base, structured_output=tools.constraint)
        prompt_text = _render(engine, body, template_tools(body.tools, tools))
        token_ids = engine.tokenizer.encode(prompt_text, add_special_tokens=False)
        params = with_max_tokens(base, resolve_max_tokens(len(token_ids), requested, engine.max_model_len, limits))
        admit(engine, token_ids, params, priority=body.priority, cache_salt=body.cache_salt, max_tokens_param=param)
        response_id = new_id("chatcmpl")
        jobs = [GenerationJob(f"{response_id}-0", prompt_text, token_ids, params, body.priority, body.cache_salt)]
        formatter = _ChatFormatter(body.n, top_logprobs, engine.tokenizer, response_id, now_s(),
                                   engine.config.model_name, tools)
        return await respond(request, state, engine, jobs, body, formatter)

    return router


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
                 created: int, model: str, tools: ToolMode | None) -> None:
        self.n = n
        self.tools = tools
        self._tool_text: dict[int, list[str]] = {}  # per streamed choice, while a forced call is generated
        self.top_logprobs = top_logprobs
        self.tokenizer = tokenizer
        self.header = {"id": response_id, "created": created, "model": model}

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.header, choices=choices, usage=usage)

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})])
                for index in range(self.n)]

    def chunk(self, choice: Choice) -> BaseModel:
        delta = choice.output
        if self.tools is not None:
            return self._tool_chunk(choice)
        return self._chunk([ChatChunkChoice(index=choice.index, delta={"content": delta.text} if delta.text else {},
                                            logprobs=self._logprobs(delta), finish_reason=delta.finish_reason,
                                            stop_reason=delta.stop_reason)])

    def _tool_chunk(self, choice: Choice) -> BaseModel:
        """A forced call streams as OpenAI's tool-call deltas once its JSON is complete: each
        call's id and name, then its arguments (one fragment each)."""
        delta = choice.output
        pieces = self._tool_text.setdefault(choice.index, [])
        pieces.append(delta.text)
        if not delta.finished:
            return self._chunk([ChatChunkChoice(index=choice.index, delta={}, logprobs=self._logprobs(delta))])
        text = "".join(self._tool_text.pop(choice.index))
        calls = tool_calls_from_output(self.tools, text) if delta.finish_reason == "stop" else None
        if calls is None:
            return self._chunk([ChatChunkChoice(index=choice.index, delta={"content": text}, logprobs=self._logprobs(delta),
                                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
        tool_deltas = [{"index": i, "id": call.id, "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments}}
                       for i, call in enumerate(calls)]
        return self._chunk([ChatChunkChoice(index=choice.index, delta={"tool_calls": tool_deltas},
                                            logprobs=self._logprobs(delta), finish_reason="tool_calls")])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel:
        return ChatCompletionResponse(**self.header, usage=usage, choices=[self._choice(c) for c in choices])

    def _choice(self, choice: Choice) -> ChatChoice:
        output = choice.output
        calls = None
        if self.tools is not None and output.finish_reason == "stop":
            calls = tool_calls_from_output(self.tools, output.text)
        if calls is not None:
            return ChatChoice(index=choice.index, message=AssistantMessage(content=None, tool_calls=calls),
                              logprobs=self._logprobs(output), finish_reason="tool_calls")
        return ChatChoice(index=choice.index, message=AssistantMessage(content=output.text),
                          logprobs=self._logprobs(output), finish_reason=output.finish_reason,
                          stop_reason=output.stop_reason)

    def _logprobs(self, completion: CompletionOutput) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(completion.logprobs or [], self.tokenizer, self.top_logprobs)
