"""Engine outputs -> OpenAI response pieces: usage and the two logprobs shapes."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine import RequestOutput, TokenLogprobs
from kvserve.server.engine_protocol import ServingTokenizer
from kvserve.server.protocol import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptTokensDetails,
                                     TopLogprob, Usage)


def usage_of(outputs: Sequence[RequestOutput]) -> Usage:
    """Prompt tokens count once per prompt (not per completion), as OpenAI counts them."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def completion_logprobs(entries: Sequence[TokenLogprobs], tokenizer: ServingTokenizer, start_offset: int,
                        num_top: int) -> CompletionLogprobs:
    """The legacy completions shape: parallel lists; `text_offset` counts characters from the
    start of the choice's text (after any echoed prompt)."""
    result = CompletionLogprobs()
    offset = start_offset
    for entry in entries:
        token = tokenizer.token_to_text(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        top = {tokenizer.token_to_text(t): lp for t, lp in entry.top[:num_top]}
        top.setdefault(token, entry.logprob)  # OpenAI includes the sampled token
        result.top_logprobs.append(top if num_top > 0 else None)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(entries: Sequence[TokenLogprobs], tokenizer: ServingTokenizer, num_top: int) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = tokenizer.token_to_text(entry.token_id)
        top = [TopLogprob(token=tokenizer.token_to_text(t), logprob=lp,
                          bytes=list(tokenizer.token_to_text(t).encode("utf-8")))
               for t, lp in entry.top[:num_top]]
        content.append(ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode("utf-8")),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)
