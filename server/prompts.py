"""Turns request prompts into token ids and runs the engine's admission check on them, all before
anything is streamed.

Tokenizing here (not in the engine) lets the server refuse a request with a 400 before the
response starts, and lets the engine skip a second tokenization: it receives the ids. What a
request must satisfy (it fits in max_model_len, its token ids exist, ...) is the engine's
admission check alone; `admit` turns its refusal into the OpenAI error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.engine import AdmissionError, SamplingParams
from kvserve.server.engine_protocol import ServingEngine, ServingTokenizer
from kvserve.server.errors import bad_request, refused
from kvserve.server.limits import ServerLimits
from kvserve.server.protocol import ChatMessage


@dataclass(frozen=True)
class TokenizedPrompt:
    text: str | None  # the prompt as sent; None for token ids (decode them once they are admitted)
    token_ids: list[int]


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: ServingTokenizer,
                       limits: ServerLimits) -> list[TokenizedPrompt]:
    """OpenAI accepts a string, a list of strings, a token-id list or a list of token-id lists."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise bad_request("prompt must not be empty.", "prompt")
    if len(items) > limits.max_prompts_per_request:
        raise bad_request(f"At most {limits.max_prompts_per_request} prompts are allowed per request, "
                          f"got {len(items)}.", "prompt")
    return [TokenizedPrompt(item, tokenizer.encode(item, add_special_tokens=True)) if isinstance(item, str)
            else TokenizedPrompt(None, item) for item in items]


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them; an assistant turn's tool calls and a tool turn's
    call id go along (templates render them). A turn with only tool calls (content null, as
    OpenAI clients send it) gets empty content, as vLLM renders it: plain templates concatenate
    `message['content']` and would fail on None."""
    rendered: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        rendered.append(message)
    return rendered


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, max_model_len: int,
                       limits: ServerLimits) -> int | None:
    """The completion budget for one prompt: the requested number, or (when not given) the rest
    of the context, as vLLM does, at most the server's per-request cap. None when the prompt
    leaves no room: the admission check then refuses the prompt."""
    if requested is not None:
        return requested
    room = max_model_len - num_prompt_tokens
    return min(room, limits.max_tokens) if room > 0 else None


async def admit(engine: ServingEngine, token_ids: list[int], params: SamplingParams, *, priority: int,
                cache_salt: str | None, renamed: Mapping[str, str] | None = None) -> None:
    """The engine's admission check (a constraint compiles meanwhile, off the event loop); a
    refusal becomes a 400 naming the request's field.
    `renamed`: engine fields this request spells otherwise (chat's budget may be
    max_completion_tokens; a constraint is named by the field it came from)."""
    try:
        await engine.check_request(token_ids, params, priority=priority, cache_salt=cache_salt)
    except AdmissionError as error:
        raise refused(error, renamed) from None
