"""A deterministic stand-in for `AsyncEngine`: byte-level tokens, letters as output, optional
per-step delay, a gate to hold generation, and failure injection. It records which requests were
started, finished and aborted, so tests can assert that a disconnect aborts its request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from kvserve.engine.admission import AdmissionCheck
from kvserve.engine.text.chat_template import ChatTemplateError
from kvserve.engine.config import EngineConfig
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.stats import EngineLoad
from kvserve.scheduler import SchedulerConfig, SchedulingPolicy
from kvserve.scheduler.output import TokenLogprobs
from kvserve.scheduler.sampling_params import SamplingParams

MODEL = "fake-model"


class EngineDeadError(RuntimeError):
    """Stands in for kvserve.engine.EngineDeadError: the server treats any failure of a dead
    engine the same way, so the fake does not need to import the real engine's modules."""


class FakeTokenizer:
    """Token id = UTF-8 byte + 1; id 0 is EOS (never generated)."""

    eos_token_id = 0
    bos_token_id = None
    chat_template = None
    vocab_size = 300

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 1 for i in ids if 1 <= i <= 256).decode("utf-8", errors="replace")

    def token_to_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if messages[-1]["role"] == "assistant" and add_generation_prompt:
            raise ChatTemplateError("the last message is from the assistant")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def expected_token(prompt_ids: Sequence[int], step: int, completion: int) -> int:
    """The fake model's output: a lowercase letter that depends on the prompt, step and index."""
    return ord("a") + (sum(prompt_ids) + 7 * step + 3 * completion) % 26 + 1


def _without_stop_prefix(text: str, stops: Sequence[str]) -> str:
    """Holds back a tail that may be the start of a stop string, as the real detokenizer does."""
    held = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    return text[: len(text) - held]


class FakeEngine:
    def __init__(self, *, max_model_len: int = 128, max_num_seqs: int = 4, step_delay: float = 0.0,
                 model: str = MODEL, scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS) -> None:
        self.config = EngineConfig(model=model, max_num_seqs=max_num_seqs, scheduling_policy=scheduling_policy.value)
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        # The real engine's admission check, over the fake model's facts.
        self.admission = AdmissionCheck(SchedulerConfig(max_model_len=max_model_len, policy=scheduling_policy),
                                        FakeTokenizer.vocab_size)
        self.step_delay = step_delay
        self.gate: asyncio.Event | None = None  # when set to an unset Event, steps wait for it
        self.dead_error: BaseException | None = None
        self.started: list[str] = []
        self.scheduling: dict[str, tuple[int, str | None]] = {}  # request id -> (priority, cache_salt)
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.active: set[str] = set()
        self.running = False
        # What the start-up summary reads.
        self.num_kv_blocks = 64
        self.block_size = 16
        self.kv_cache_bytes = 64 * 16 * 1024
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.model_config = ModelConfig(
            architecture="llama", vocab_size=FakeTokenizer.vocab_size, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=None,
            rms_norm_eps=1e-5, max_position_embeddings=max_model_len, tie_word_embeddings=True,
            attention_bias=False, bos_token_id=None, eos_token_ids=(0,))

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.active)

    @property
    def load(self) -> EngineLoad:
        """One block per active request: enough for the gauges to follow the traffic."""
        used = len(self.active)
        return EngineLoad(used, 0, self.num_kv_blocks, used, 0, self.num_kv_blocks - used)

    def start(self) -> None:
        self.running = True

    def shutdown(self) -> None:
        self.running = False

    def fail(self, error: BaseException) -> None:
        self.dead_error = error

    async def check_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                            priority: int = 0, cache_salt: str | None = None) -> None:
        self.admission.check(prompt_token_ids, sampling_params, priority=priority, cache_salt=cache_salt)

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str,
                       *, priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_error}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = sampling_params
        assert params.max_tokens is not None and len(ids) + params.max_tokens <= self.max_model_len
        self.started.append(request_id)
        self.scheduling[request_id] = (priority, cache_salt)
        self.active.add(request_id)
        tokens: list[list[int]] = [[] for _ in range(params.n)]
        texts = [""] * params.n
        reasons: list[str | None] = [None] * params.n
        completed = False
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(self.step_delay)
                if self.gate is not None:
                    await self.gate.wait()
                if self.dead_error is not None:
                    raise EngineDeadError(f"the engine failed: {self.dead_error}")
                deltas = []
                for c in range(params.n):
                    if reasons[c] is not None:
                        continue
                    token = expected_token(ids, step, c)
                    tokens[c].append(token)
                    logprobs = None
                    if params.logprobs is not None:
                        top = [(token, -0.25)] + [(ord("A") + k + 1, -2.0 - k) for k in range(params.logprobs)]
                        logprobs = [TokenLogprobs(token, -0.25, 1, top[: params.logprobs])]
                    text = self.tokenizer.decode(tokens[c])
                    hit = next((s for s in params.stop if s in text), None)
                    stop_reason = None
                    if hit is not None:
                        text = text[: text.index(hit)] + (hit if params.include_stop_str_in_output else "")
                        reasons[c], stop_reason = "stop", hit
                    elif len(tokens[c]) == params.max_tokens:
                        reasons[c] = "length"
                    if reasons[c] is None:
                        text = _without_stop_prefix(text, params.stop)
                    # Like the real engine, report only what is new since the last step.
                    deltas.append(CompletionOutput(index=c, text=text[len(texts[c]):], token_ids=[token],
                                                   finish_reason=reasons[c], stop_reason=stop_reason,
                                                   logprobs=logprobs))
                    texts[c] = text
                done = all(r is not None for r in reasons)
                yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=ids, finished=done,
                                    num_cached_tokens=0, outputs=deltas)
                if done:
                    completed = True
                    return
        finally:
            self.active.discard(request_id)
            (self.finished if completed else self.aborted).append(request_id)
