"""GrammarCompiler's cache: bounded, least recently used out first, one compile per spec however
many callers wait on it, failures not kept; compiles run on the compile threads."""

from __future__ import annotations

import threading

import pytest

from kvserve.engine import GrammarKind, StructuredOutputParams
from kvserve.engine.structured_output import GrammarCompiler, StructuredOutputError


def regex(spec: str) -> StructuredOutputParams:
    return StructuredOutputParams(GrammarKind.REGEX, spec)


class CountingCompile:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, params: StructuredOutputParams) -> tuple[str, int]:
        with self.lock:
            self.calls.append(params.spec)
            self.threads.add(threading.current_thread().name)
        if params.spec == "bad":
            raise StructuredOutputError("the regex constraint cannot be compiled: bad")
        return (params.spec, len(self.calls))


@pytest.fixture
def counting():
    compile_ = CountingCompile()
    compiler = GrammarCompiler(compile_, cache_size=3)
    yield compiler, compile_
    compiler.close()


def test_the_cache_is_bounded_and_evicts_the_least_recently_used(counting):
    compiler, compile_ = counting
    for spec in ["a", "b", "c"]:
        compiler.compile(regex(spec))
    compiler.compile(regex("a"))  # a hit: "a" is now the most recently used
    compiler.compile(regex("d"))  # evicts "b"
    assert len(compiler) == 3 and compile_.calls == ["a", "b", "c", "d"]
    compiler.compile(regex("a"))
    compiler.compile(regex("c"))
    assert compile_.calls == ["a", "b", "c", "d"]  # still cached
    compiler.compile(regex("b"))  # compiled again (and evicts "d")
    assert compile_.calls == ["a", "b", "c", "d", "b"]
    for i in range(50):
        compiler.compile(regex(f"x{i}"))
    assert len(compiler) == 3


def test_a_hit_returns_the_same_grammar(counting):
    compiler, _ = counting
    assert compiler.compile(regex("a")) is compiler.compile(regex("a"))
    assert compiler.compile(StructuredOutputParams(GrammarKind.GRAMMAR, "a")) != compiler.compile(regex("a"))


def test_a_failed_compile_raises_for_every_waiter_and_is_not_kept(counting):
    compiler, compile_ = counting
    with pytest.raises(StructuredOutputError, match="cannot be compiled"):
        compiler.compile(regex("bad"))
    assert len(compiler) == 0
    with pytest.raises(StructuredOutputError):
        compiler.compile(regex("bad"))
    assert compile_.calls == ["bad", "bad"]  # tried again: not cached


def test_concurrent_callers_share_one_compile_on_the_compile_threads():
    release = threading.Event()
    calls: list[str] = []

    def gated(params: StructuredOutputParams) -> str:
        calls.append(threading.current_thread().name)
        assert release.wait(60)
        return params.spec

    compiler = GrammarCompiler(gated)
    try:
        futures = [compiler.compile_async(regex("a")) for _ in range(5)]  # return at once, unblocked
        assert not any(f.done() for f in futures)
        release.set()
        assert [f.result(timeout=60) for f in futures] == ["a"] * 5
    finally:
        release.set()
        compiler.close()
    assert len(calls) == 1 and calls[0].startswith("kvserve-grammar")


def test_a_compile_evicted_while_in_flight_still_completes():
    release = threading.Event()

    def gated(params: StructuredOutputParams) -> str:
        if params.spec == "slow":
            assert release.wait(60)
        return params.spec

    compiler = GrammarCompiler(gated, cache_size=1, threads=2)
    try:
        slow = compiler.compile_async(regex("slow"))
        assert compiler.compile(regex("fast")) == "fast"  # evicts the slow one's entry, not its compile
        release.set()
        assert slow.result(timeout=60) == "slow"
        assert len(compiler) == 1
    finally:
        release.set()
        compiler.close()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        GrammarCompiler(CountingCompile(), cache_size=0)
