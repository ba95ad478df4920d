"""AsyncEngine's thread bridge, over a scripted stand-in for LLMEngine (no model): outputs reach
the awaiting coroutine, an abandoned stream aborts its request, and a failing step fails every
in-flight request with EngineDeadError instead of hanging."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve.engine import AdmissionError, AsyncEngine, EngineDeadError, SamplingParams
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.stats import EngineLoad


class ScriptedEngine:
    """Each request yields `tokens_per_request` tokens, one per step; `fail_at_step` raises."""

    def __init__(self, tokens_per_request: int = 3, fail_at_step: int | None = None) -> None:
        self.tokens_per_request = tokens_per_request
        self.fail_at_step = fail_at_step
        self.steps = 0
        self.requests: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    class tokenizer:  # noqa: N801 - stands in for the Tokenizer instance
        @staticmethod
        def encode(text: str) -> list[int]:
            return [ord(c) for c in text]

    def add_request(self, request_id, prompt, params, *, arrival_time=None, priority=0, cache_salt=None,
                    prompt_token_ids=None) -> None:
        if not prompt_token_ids:  # stands in for the admission check
            raise AdmissionError("The prompt is empty: give at least one token.", "prompt")
        self.requests[request_id] = []

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        if self.requests.pop(request_id, None) is None:
            return []
        self.aborted.append(request_id)
        return [self._output(request_id, [], "abort")]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """No worker processes to stop."""

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.requests), 0, 8, len(self.requests), 0, 8 - len(self.requests))

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("injected failure")
        outputs = []
        for request_id, tokens in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) == self.tokens_per_request
            outputs.append(self._output(request_id, [tokens[-1]], "length" if done else None))  # a delta
            if done:
                del self.requests[request_id]
        return outputs

    @staticmethod
    def _output(request_id: str, tokens: list[int], reason: str | None) -> RequestOutput:
        completion = CompletionOutput(index=0, text="x" * len(tokens), token_ids=tokens, finish_reason=reason)
        return RequestOutput(request_id, None, [1], [completion], finished=reason is not None)


async def collect(engine: AsyncEngine, request_id: str, prompt: str = "hi") -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, SamplingParams(max_tokens=3), request_id)]


@pytest.fixture
def run():
    engines = []

    def start(engine: ScriptedEngine) -> AsyncEngine:
        async_engine = AsyncEngine(engine)  # type: ignore[arg-type]
        async_engine.start()
        engines.append(async_engine)
        return async_engine

    yield start
    for engine in engines:
        engine.shutdown()


def test_outputs_stream_to_each_request(run):
    engine = run(ScriptedEngine(tokens_per_request=3))

    async def main():
        return await asyncio.wait_for(asyncio.gather(collect(engine, "a"), collect(engine, "b")), 10)

    a, b = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in a] == [[0], [1], [2]]
    assert a[-1].finished and b[-1].finished
    assert engine.num_unfinished_requests == 0


def test_abandoned_stream_aborts_its_request(run):
    scripted = ScriptedEngine(tokens_per_request=10_000)
    engine = run(scripted)

    async def main():
        stream = engine.generate("hi", SamplingParams(max_tokens=3), "gone")
        await stream.__anext__()
        await stream.aclose()  # the client went away
        for _ in range(200):
            if scripted.aborted:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert scripted.aborted == ["gone"]
    assert not scripted.requests


def test_step_failure_fails_in_flight_requests_and_marks_engine_dead(run):
    engine = run(ScriptedEngine(tokens_per_request=100, fail_at_step=3))

    async def main():
        results = await asyncio.wait_for(
            asyncio.gather(collect(engine, "a"), collect(engine, "b"), return_exceptions=True), 10)
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert engine.is_dead
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, "late"))


def test_a_refused_request_raises_from_generate_and_leaves_nothing_behind(run):
    scripted = ScriptedEngine()
    engine = run(scripted)
    with pytest.raises(AdmissionError, match="empty") as refused:
        asyncio.run(collect(engine, "r", prompt=""))  # "" tokenizes to no tokens
    assert refused.value.field == "prompt"
    assert scripted.requests == {} and engine.num_unfinished_requests == 0
