"""Grammar compiles off the caller's thread, with a bounded cache by spec.

A schema can take seconds to compile; done on the server's event loop it would stall every
stream, and done on the engine thread every step. So compiles run on a small thread pool of
their own, and callers wait on a future:

    server (event loop)   await AsyncEngine.check_request ── compile_async ──► compile thread
    engine thread         add_request(grammar=<the compiled grammar>)  (builds a matcher only)

The engine thread never touches the cache in a server: it is handed the compiled grammar. The
lock below guards the cache's dict only and is never held while compiling.

Compiled grammars, and compiles in flight, are cached by spec (the `cache_size` most recently
used): clients repeat the same schema across many requests, and two requests sending one schema
at once share one compile. A spec that fails to compile is not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from kvserve.scheduler.structured_output_params import GrammarKind, StructuredOutputParams

Grammar = TypeVar("Grammar")

DEFAULT_CACHE_SIZE = 64
# Two: one slow schema does not hold up every other constrained request, and a 2-core machine
# still has a core for the engine's steps.
DEFAULT_COMPILE_THREADS = 2


class GrammarCompiler(Generic[Grammar]):
    """`compile_grammar(params)` does the work (XGrammarCompile in the engine; tests inject their
    own); it raises StructuredOutputError for a spec that cannot be compiled."""

    def __init__(self, compile_grammar: Callable[[StructuredOutputParams], Grammar], *,
                 cache_size: int = DEFAULT_CACHE_SIZE, threads: int = DEFAULT_COMPILE_THREADS) -> None:
        if cache_size < 1 or threads < 1:
            raise ValueError(f"cache_size and threads must be at least 1, got {cache_size} and {threads}")
        self._compile_grammar = compile_grammar
        self.cache_size = cache_size
        self._threads = threads
        self._cache: OrderedDict[tuple[GrammarKind, str], Future[Grammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None  # started on the first compile

    def compile_async(self, params: StructuredOutputParams) -> Future[Grammar]:
        """The compiled grammar, or the compile under way; its result raises StructuredOutputError
        when the spec cannot be compiled. Returns at once; safe from any thread."""
        key = (params.kind, params.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="kvserve-grammar")
            future = self._executor.submit(self._compile_grammar, params)
            self._cache[key] = future
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # a compile in flight still completes for its waiters
        future.add_done_callback(lambda done: self._forget_if_failed(key, done))
        return future

    def compile(self, params: StructuredOutputParams) -> Grammar:
        """compile_async, waited for: for callers with nothing else to do meanwhile (offline LLM)."""
        return self.compile_async(params).result()

    def __len__(self) -> int:
        """Specs cached (compiled or compiling)."""
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        """Stops the compile threads; a compile under way finishes in the background."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def _forget_if_failed(self, key: tuple[GrammarKind, str], future: Future[Grammar]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]
