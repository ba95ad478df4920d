"""Drive one benchmark run: warm up, send requests on their arrival schedule, stop at the bounds.

A run always ends by itself: after the last request, or at `duration_s` whichever comes first,
and each request is capped by the endpoint's request timeout. At the duration cap, requests still
in flight are cancelled and counted, not silently dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from .arrivals import ArrivalProcess, paced
from .client import Endpoint, send_request
from .datasets import BenchRequest
from .http_stream import StreamClient
from .records import RequestRecord, RunResult


class BenchmarkError(RuntimeError):
    """The run cannot produce meaningful numbers (e.g. the warm-up failed)."""


@dataclass(frozen=True)
class LoadConfig:
    arrivals: ArrivalProcess = ArrivalProcess()
    max_concurrency: int | None = None  # None: no client-side cap on requests in flight
    duration_s: float = 600.0  # hard cap on the measured phase
    num_warmups: int = 1  # sent (and checked) before measuring; their numbers are discarded
    seed: int = 0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"--duration must be a finite number of seconds > 0, got {self.duration_s}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")


async def warm_up(http: StreamClient, endpoint: Endpoint, requests: Sequence[BenchRequest], count: int) -> None:
    """Send `count` requests concurrently; any failure stops the run with the server's reason."""
    if count == 0:
        return
    picks = [requests[i % len(requests)] for i in range(count)]
    records = await asyncio.gather(*(send_request(http, endpoint, r) for r in picks))
    for record in records:
        if not record.success:
            raise BenchmarkError(
                f"warm-up request to {endpoint.url} failed ({record.error_type}): {record.error_message}. "
                "Check --base-url, --endpoint, --model and --api-key."
            )


async def run_load(
    endpoint: Endpoint,
    requests: Sequence[BenchRequest],
    load: LoadConfig,
) -> RunResult:
    if not requests:
        raise BenchmarkError("no requests to send: --num-prompts must be >= 1")
    for request in requests:
        endpoint.check_prompt(request)
    # The client has no connection cap: concurrency is the benchmark's to control, not a pool's,
    # or queueing in the pool would show up as server latency. Only the given URL is contacted.
    async with StreamClient(connect_timeout_s=endpoint.request_timeout_s) as http:
        await warm_up(http, endpoint, requests, load.num_warmups)
        return await _measure(http, endpoint, requests, load)


async def _measure(
    http: StreamClient, endpoint: Endpoint, requests: Sequence[BenchRequest], load: LoadConfig
) -> RunResult:
    offsets = load.arrivals.offsets(len(requests), load.seed)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    tasks: list[asyncio.Task[RequestRecord]] = []
    in_flight = 0

    async def one(request: BenchRequest) -> RequestRecord:
        nonlocal in_flight
        async with limit or contextlib.nullcontext():
            in_flight += 1
            try:
                return await send_request(http, endpoint, request)
            finally:
                in_flight -= 1

    progress = tqdm(total=len(requests), disable=not load.show_progress, unit="req", desc="benchmark")

    async def issue_all() -> None:
        async for request in paced(requests, offsets, start):
            task = asyncio.create_task(one(request))
            task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)

    # asyncio.wait, not wait_for: a timeout leaves the tasks running, so the requests in flight at
    # the cap can be counted before they are cancelled.
    start = time.perf_counter()
    deadline = start + load.duration_s
    try:
        issuer = asyncio.create_task(issue_all())
        await asyncio.wait([issuer], timeout=load.duration_s)
        if not issuer.done():
            issuer.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        pending = [t for t in tasks if not t.done()]
        hit_cap = bool(pending) or not issuer.done() or issuer.cancelled()
        end = deadline if hit_cap else time.perf_counter()
        cancelled = in_flight
        for task in pending:
            task.cancel()
        await asyncio.gather(issuer, *pending, return_exceptions=True)
    finally:
        progress.close()

    records = tuple(t.result() for t in tasks if not t.cancelled())
    return RunResult(
        records=records,
        cancelled=cancelled,
        not_sent=len(requests) - len(records) - cancelled,
        duration_s=end - start,
        hit_duration_cap=hit_cap,
    )
