"""A FakeEngine whose every completion is a given text, a few characters per step: for tests of
how the server reads a model's output (tool calls) without a model that writes it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.scheduler.output import TokenLogprobs
from kvserve.scheduler.sampling_params import SamplingParams
from tests.server.fake_engine import FakeEngine


class ScriptedEngine(FakeEngine):
    """`script` may also be a function of the prompt's text: a reply that depends on the
    conversation (an answer once the tool's result is in it)."""

    def __init__(self, script: str | Callable[[str], str] = "", chars_per_step: int = 3) -> None:
        super().__init__(max_model_len=4096)
        self.script = script
        self.chars_per_step = chars_per_step
        self.last_params: SamplingParams | None = None
        self.last_prompt_ids: list[int] = []

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str,
                       *, priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = sampling_params
        self.last_params = params
        self.last_prompt_ids = ids
        assert params.max_tokens is not None
        self.started.append(request_id)
        # One "token" per character; the reply ends with the script (stop) or at max_tokens (length).
        script = self.script(self.tokenizer.decode(ids)) if callable(self.script) else self.script
        text = script[:params.max_tokens]
        reason = "stop" if len(text) == len(script) else "length"
        steps = range(0, max(len(text), 1), self.chars_per_step)
        for start in steps:
            await asyncio.sleep(0)
            piece = text[start:start + self.chars_per_step]
            token_ids = [ord(c) for c in piece]
            last = start + self.chars_per_step >= len(text)
            logprobs = None if params.logprobs is None else [TokenLogprobs(t, -0.5, 1, []) for t in token_ids]
            yield RequestOutput(
                request_id=request_id, prompt=None, prompt_token_ids=ids, finished=last, num_cached_tokens=0,
                outputs=[CompletionOutput(index=c, text=piece, token_ids=token_ids, finish_reason=reason if last else None,
                                          logprobs=logprobs) for c in range(params.n)])
        self.finished.append(request_id)
