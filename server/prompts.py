"""Turns request prompts into token ids and checks they fit, all before anything is streamed.

Tokenizing here (not in the engine) lets the server answer 400 for an over-long prompt with both
numbers, and lets the engine skip a second tokenization: it receives the ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.llm_engine import PromptTooLongError
from kvserve.server.engine_protocol import ServingTokenizer
from kvserve.server.errors import bad_request
from kvserve.server.limits import ServerLimits
from kvserve.server.protocol import ChatMessage


@dataclass(frozen=True)
class TokenizedPrompt:
    text: str  # what echo returns; for token-id prompts, their decoding
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
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(TokenizedPrompt(item, tokenizer.encode(item, add_special_tokens=True)))
        else:
            check_token_ids(item, tokenizer.vocab_size, "prompt")
            prompts.append(TokenizedPrompt(tokenizer.decode(item, skip_special_tokens=False), item))
    for tokenized in prompts:
        if not tokenized.token_ids:
            raise bad_request("prompt must contain at least one token.", "prompt")
    return prompts


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text()} for m in messages]


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", param)


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, max_model_len: int,
                       limits: ServerLimits, param: str = "max_tokens") -> int:
    """The completion budget for one prompt: the requested number, which must fit with the
    prompt in max_model_len, or (when not given) whatever fits, up to the server's cap."""
    room = max_model_len - num_prompt_tokens
    if room <= 0 or (requested is not None and requested > room):
        error = PromptTooLongError(num_prompt_tokens, requested, max_model_len, max_tokens_param=param)
        raise bad_request(str(error), error.param, code="context_length_exceeded")
    if requested is None:
        return min(room, limits.max_tokens)
    return requested
