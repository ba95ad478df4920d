"""Runs one HTTP request's prompts through the engine concurrently and merges their outputs.

Each prompt gets its own task pumping `engine.generate` (per-step deltas) into one queue, so a
batched request's prompts progress together. Leaving the iteration early (client gone, cancellation) cancels the
pumps, which makes the engine abort those requests and free their blocks. When the server's drain
grace period runs out (`abort_all`), unfinished completions end with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from kvserve.engine import CompletionOutput, FinishReason, RequestOutput, SamplingParams
from kvserve.server.engine_protocol import ServingEngine


@dataclass(frozen=True)
class GenerationJob:
    request_id: str
    prompt_text: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class GenerationUpdate:
    job_index: int
    output: RequestOutput  # a delta, as the engine reports it


@dataclass(frozen=True)
class _Finished:
    job_index: int


@dataclass(frozen=True)
class _Failed:
    job_index: int
    error: Exception


@dataclass(frozen=True)
class _AbortAll:
    pass


_Item = GenerationUpdate | _Finished | _Failed | _AbortAll


async def generate_all(engine: ServingEngine, jobs: Sequence[GenerationJob],
                       abort_all: asyncio.Event) -> AsyncIterator[GenerationUpdate]:
    queue: asyncio.Queue[_Item] = asyncio.Queue()

    async def pump(index: int, job: GenerationJob) -> None:
        try:
            async for output in engine.generate(job.prompt_token_ids, job.params, job.request_id,
                                                priority=job.priority, cache_salt=job.cache_salt):
                queue.put_nowait(GenerationUpdate(index, output))
        except Exception as error:  # EngineDeadError and anything else: the consumer decides
            queue.put_nowait(_Failed(index, error))
        else:
            queue.put_nowait(_Finished(index))

    async def watch_abort() -> None:
        await abort_all.wait()
        queue.put_nowait(_AbortAll())

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    watcher = asyncio.create_task(watch_abort())
    last: dict[int, RequestOutput] = {}
    remaining = set(range(len(jobs)))
    try:
        while remaining:
            item = await queue.get()
            if isinstance(item, GenerationUpdate):
                last[item.job_index] = item.output
                yield item
            elif isinstance(item, _Finished):
                remaining.discard(item.job_index)
            elif isinstance(item, _Failed):
                raise item.error
            else:
                await _cancel(tasks)
                for index in sorted(remaining):
                    yield GenerationUpdate(index, aborted_output(jobs[index], last.get(index)))
                remaining.clear()
    finally:
        watcher.cancel()
        await _cancel(tasks)


def aborted_output(job: GenerationJob, last: RequestOutput | None) -> RequestOutput:
    """The last delta of a request the server stopped: every completion marked "abort" (the
    caller's accumulator ignores the ones that had already finished)."""
    completions = [CompletionOutput(index=i, text="", token_ids=[], finish_reason=FinishReason.ABORT)
                   for i in range(job.params.n)]
    if last is None:
        return RequestOutput(request_id=job.request_id, prompt=job.prompt_text,
                             prompt_token_ids=job.prompt_token_ids, outputs=completions, finished=True)
    return replace(last, outputs=completions, finished=True)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    # Waiting lets each engine.generate run its abort before we report the request as gone.
    await asyncio.gather(*tasks, return_exceptions=True)
