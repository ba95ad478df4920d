"""The prompt's logprobs in the two shapes clients read them.

- Legacy completions with `echo` + `logprobs` (OpenAI; what lm-eval's loglikelihood tasks use):
  the prompt tokens lead the choice's `logprobs` lists, the first with `token_logprobs` and
  `top_logprobs` null (nothing precedes it), then the generated tokens follow.
- vLLM's `prompt_logprobs`: per prompt token, null for the first, else a map from token id to
  {logprob, rank, decoded_token} holding the prompt token and the top alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine import TokenLogprobs
from kvserve.server.engine_protocol import ServingTokenizer
from kvserve.server.formatting import completion_logprobs
from kvserve.server.protocol import CompletionLogprobs, PromptLogprob


def echoed_completion_logprobs(prompt_token_ids: Sequence[int], prompt: Sequence[TokenLogprobs | None],
                               generated: Sequence[TokenLogprobs], tokenizer: ServingTokenizer,
                               num_top: int) -> CompletionLogprobs:
    """Prompt entries, then generated ones, with one running `text_offset` from the prompt's start."""
    first = tokenizer.token_to_text(prompt_token_ids[0])
    scored = completion_logprobs([e for e in prompt[1:] if e is not None], tokenizer, len(first), num_top)
    offset = len(first) + sum(len(t) for t in scored.tokens)
    tail = completion_logprobs(generated, tokenizer, offset, num_top)
    return CompletionLogprobs(tokens=[first, *scored.tokens, *tail.tokens],
                              token_logprobs=[None, *scored.token_logprobs, *tail.token_logprobs],
                              top_logprobs=[None, *scored.top_logprobs, *tail.top_logprobs],
                              text_offset=[0, *scored.text_offset, *tail.text_offset])


def vllm_prompt_logprobs(prompt: Sequence[TokenLogprobs | None], tokenizer: ServingTokenizer,
                         num_top: int) -> list[dict[str, PromptLogprob] | None]:
    result: list[dict[str, PromptLogprob] | None] = []
    for entry in prompt:
        if entry is None:
            result.append(None)
            continue
        alternatives = {str(token): PromptLogprob(logprob=logprob, rank=rank, decoded_token=tokenizer.token_to_text(token))
                        for rank, (token, logprob) in enumerate(entry.top[:num_top], start=1)}
        alternatives[str(entry.token_id)] = PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                          decoded_token=tokenizer.token_to_text(entry.token_id))
        result.append(alternatives)
    return result
