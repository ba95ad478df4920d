"""AsyncEngine: the LLMEngine step loop on its own thread, beside an asyncio event loop.

    event loop (server)                      engine thread
    ───────────────────                      ─────────────
    check_request: grammar ──► compile thread (engine/structured_output/grammar_compiler.py)
    generate(): tokenize ───────────cmd──►  add_request (admission check; the compiled grammar)
                 await queue.get() ◄─out───  step() ... step()
    client gone: abort ─────────────cmd──►  abort_request (before the next step)

The event loop never waits on a model step, and the engine never waits on the loop: commands go
through a thread-safe queue, and a step's outputs go back in one call_soon_threadsafe per event
loop (not one per request: each call writes to the loop's wake-up pipe, and a step at 64 running
requests would pay 64 of them, plus as many chances for the loop to wake and take the GIL in the
middle of the hand-off). If a step raises, the engine is marked dead and every
in-flight request gets EngineDeadError instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.stats import EngineLoad, StatsListener
from kvserve.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests cannot be served until the server restarts."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """Runs on the event loop: one step's outputs into their requests' queues, in step order."""
    for queue_, output in batch:
        queue_.put_nowait(output)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.dead_error: BaseException | None = None
        # Republished by the engine thread after every loop iteration (an atomic reference swap),
        # so readers on other threads always see one consistent snapshot.
        self._load = engine.load()

    @classmethod
    def from_config(cls, config: EngineConfig, stats_listeners: Sequence[StatsListener] = ()) -> "AsyncEngine":
        return cls(LLMEngine.from_config(config, stats_listeners))

    # ------------------------------------------------------------------ facts for the server

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def block_size(self) -> int:
        return self.engine.executor.driver.kv_cache_config.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.executor.driver.kv_cache_config.num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        """Over all tensor-parallel ranks (each holds its share of every block's heads)."""
        return self.engine.executor.driver.kv_cache_config.total_bytes * self.engine.config.tensor_parallel_size

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.executor.driver.runner.model_dtype

    @property
    def device(self) -> torch.device:
        return self.engine.executor.driver.runner.device

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def load(self) -> EngineLoad:
        """Requests and KV blocks as of the engine loop's last iteration (at most one step old)."""
        return self._load

    @property
    def num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine.close()

    # ------------------------------------------------------------------ requests

    async def check_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                            priority: int = 0, cache_salt: str | None = None) -> None:
        """The engine's admission check, for the event loop (it reads only immutable facts): a
        caller that must refuse before it answers (the HTTP server) runs it first. A constraint
        is compiled meanwhile on the compile threads (a bad one raises StructuredOutputError);
        generate then finds it in the cache."""
        self.engine.admission.check(prompt_token_ids, sampling_params, priority=priority, cache_salt=cache_salt)
        await self._grammar(sampling_params)

    async def _grammar(self, params: SamplingParams) -> Any:
        if params.structured_output is None:
            return None
        return await asyncio.wrap_future(self.engine.grammar_compiler.compile_async(params.structured_output))

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, *, priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's deltas. A request the engine refuses (AdmissionError) raises
        from the first iteration, before any output."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_error}") from self.dead_error
        grammar = await self._grammar(sampling_params)  # off the engine thread, which only matches
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"Request id {request_id!r} is already in use.")
            self._streams[request_id] = stream
        if self.dead_error is not None:  # died while we registered: _fail_all may have missed us
            with self._lock:
                self._streams.pop(request_id, None)
            raise EngineDeadError(f"the engine has failed: {self.dead_error}") from self.dead_error
        arrival = time.monotonic()
        self._submit(lambda: self._add(request_id, text, token_ids, sampling_params, priority, cache_salt, arrival,
                                       grammar, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort_request(request_id))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ------------------------------------------------------------------ engine thread

    def _add(self, request_id, text, token_ids, params, priority, cache_salt, arrival, grammar,
             stream: _Stream) -> None:
        try:
            self.engine.add_request(request_id, text if text is not None else token_ids, params,
                                    arrival_time=arrival, priority=priority, cache_salt=cache_salt,
                                    prompt_token_ids=token_ids, grammar=grammar)
        except ValueError as error:  # the admission check refused it (or a duplicate id)
            stream.put(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands one step's outputs to their event loops, one batch per loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.engine.has_unfinished_requests() and self._commands.empty():
                    self._wakeup.wait(_IDLE_WAIT_S)
                self._wakeup.clear()
                while not self._commands.empty():
                    self._commands.get()()
                outputs = self.engine.step()
                if outputs:
                    self._deliver(outputs)
                self._load = self.engine.load()
        except BaseException as error:  # noqa: BLE001 - any failure must reach the waiting clients
            logger.exception("engine loop failed; marking the engine dead")
            self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        self.dead_error = error
        dead = EngineDeadError(f"the engine failed: {type(error).__name__}: {error}")
        dead.__cause__ = error
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(dead)
