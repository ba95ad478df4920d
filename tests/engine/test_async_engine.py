"""AsyncEngine's thread bridge, over a scripted stand-in for LLMEngine (no model): outputs reach
the awaiting coroutine, an abandoned stream aborts its request, a failing step fails every
in-flight request with EngineDeadError instead of hanging, and a grammar compiles on the compile
threads while other requests stream."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve.engine import (AdmissionError, AsyncEngine, EngineDeadError, GrammarKind, SamplingParams,
                            StructuredOutputParams)
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.stats import EngineLoad
from kvserve.engine.structured_output import GrammarCompiler, StructuredOutputError


def _compile_regex(params: StructuredOutputParams) -> str:
    if params.spec == "(":
        raise StructuredOutputError("the regex constraint cannot be compiled: unbalanced")
    return f"grammar for {params.spec}"


class _Admission:
    @staticmethod
    def check(prompt_token_ids, params, *, priority=0, cache_salt=None) -> None:
        if not prompt_token_ids:  # stands in for the admission check
            raise AdmissionError("The prompt is empty: give at least one token.", "prompt")


class ScriptedEngine:
    """Each request yields `tokens_per_request` tokens, one per step; `fail_at_step` raises.
    Constraints compile with `compile_grammar`; `grammars` keeps what each request was given."""

    def __init__(self, tokens_per_request: int = 3, fail_at_step: int | None = None,
                 compile_grammar=_compile_regex) -> None:
        self.tokens_per_request = tokens_per_request
        self.fail_at_step = fail_at_step
        self.steps = 0
        self.requests: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.lock = threading.Lock()
        self.admission = _Admission()
        self.grammar_compiler = GrammarCompiler(compile_grammar)
        self.grammars: dict[str, object] = {}

    class tokenizer:  # noqa: N801 - stands in for the Tokenizer instance
        @staticmethod
        def encode(text: str) -> list[int]:
            return [ord(c) for c in text]

    def add_request(self, request_id, prompt, params, *, arrival_time=None, priority=0, cache_salt=None,
                    prompt_token_ids=None, grammar=None) -> None:
        self.admission.check(prompt_token_ids, params)
        assert (grammar is None) == (params.structured_output is None), "the engine thread must not compile"
        if grammar is not None:
            self.grammars[request_id] = grammar
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
        self.grammar_compiler.close()

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


async def collect(engine: AsyncEngine, request_id: str, prompt: str = "hi",
                  params: SamplingParams | None = None) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=3) if params is None else params
    return [out async for out in engine.generate(prompt, params, request_id)]


async def check_then_collect(engine: AsyncEngine, request_id: str, params: SamplingParams) -> list[RequestOutput]:
    """What the server does: the admission check (and the compile) first, then the stream."""
    await engine.check_request([1], params)
    return await collect(engine, request_id, params=params)


def constrained(spec: str) -> SamplingParams:
    return SamplingParams(max_tokens=3, structured_output=StructuredOutputParams(GrammarKind.REGEX, spec))


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


def test_a_slow_compile_stalls_neither_the_event_loop_nor_other_requests(run):
    release, started = threading.Event(), threading.Event()
    compiled_on: list[str] = []

    def slow_compile(params: StructuredOutputParams) -> str:
        compiled_on.append(threading.current_thread().name)
        started.set()
        assert release.wait(60), "the test never released the compile"
        return f"grammar for {params.spec}"

    scripted = ScriptedEngine(tokens_per_request=3, compile_grammar=slow_compile)
    engine = run(scripted)

    async def main():
        slow = asyncio.create_task(check_then_collect(engine, "slow", constrained("a+")))
        twin = asyncio.create_task(check_then_collect(engine, "twin", constrained("a+")))  # the same spec
        assert await asyncio.to_thread(started.wait, 30)
        # The compile is still held: this loop, and the engine thread, serve another request meanwhile.
        free = await asyncio.wait_for(collect(engine, "free"), 30)
        assert not slow.done() and not twin.done()
        release.set()
        return free, await asyncio.wait_for(asyncio.gather(slow, twin), 30)

    try:
        free, (slow, twin) = asyncio.run(main())
    finally:
        release.set()
    assert free[-1].finished and slow[-1].finished and twin[-1].finished
    assert scripted.grammars == {"slow": "grammar for a+", "twin": "grammar for a+"}
    assert len(compiled_on) == 1 and compiled_on[0].startswith("kvserve-grammar")  # one compile, shared


def test_a_constraint_that_cannot_compile_is_refused_before_the_stream(run):
    scripted = ScriptedEngine()
    engine = run(scripted)
    with pytest.raises(StructuredOutputError, match="cannot be compiled") as refused:
        asyncio.run(check_then_collect(engine, "bad", constrained("(")))
    assert refused.value.field == "structured_output"
    with pytest.raises(StructuredOutputError):  # generate alone refuses it too, from its first iteration
        asyncio.run(collect(engine, "bad", params=constrained("(")))
    assert scripted.requests == {} and engine.num_unfinished_requests == 0
    assert len(scripted.grammar_compiler) == 0  # a failed spec is not kept
