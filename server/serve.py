"""`kvserve serve` at run time: listen first, load the model, serve, drain on SIGTERM, exit 0.

    start ──► listening (/health 503 "loading") ──► model loaded (/health 200) ──SIGTERM──►
    draining (/health 503, new requests 503 + Retry-After, in-flight ones continue)
    ──all done, or grace period over (the rest end with finish_reason "abort")──► exit 0

A second SIGTERM/SIGINT while draining skips the rest of the grace period.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TextIO

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvserve.engine import AsyncEngine, ConfigError, EngineConfig, StatsListener
from kvserve.server.app import build_app, serving_state
from kvserve.server.connection_guard import ConnectionLimits, ConnectionListener, ensure_descriptors, guarded_protocol
from kvserve.server.event_loop import run_event_loop
from kvserve.server.info_routes import kvserve_version
from kvserve.server.log_stats import LogStats
from kvserve.server.metrics import ServerMetrics
from kvserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig, Sequence[StatsListener]], AsyncEngine]


class _SignalAwareServer(uvicorn.Server):
    """uvicorn stops listening on the first SIGTERM; we must keep answering (503) while we drain,
    so the signal is handed to our shutdown sequence, which sets `should_exit` when it is done.
    Not recording the signal also keeps uvicorn from re-raising it at exit (exit code 0)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal(sig)


def run_server(engine_config: EngineConfig, settings: ServerSettings,
               engine_factory: EngineFactory = AsyncEngine.from_config, out: TextIO = sys.stdout) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_event_loop(_serve(engine_config, settings, engine_factory, out))
    except SystemExit as exit_:  # uvicorn exits this way when it cannot bind the port
        return exit_.code if isinstance(exit_.code, int) else 1


async def _serve(engine_config: EngineConfig, settings: ServerSettings, engine_factory: EngineFactory,
                 out: TextIO) -> int:
    metrics = ServerMetrics(engine_config.model_name, metrics_info(engine_config))
    app = build_app(None, settings, metrics=metrics)
    state = serving_state(app)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals_seen: list[int] = []

    def on_signal(sig: int) -> None:  # runs inside a signal handler: thread-safe calls only
        signals_seen.append(sig)
        loop.call_soon_threadsafe(stop.set)
        if len(signals_seen) > 1:
            loop.call_soon_threadsafe(state.abort_all.set)

    ensure_descriptors(settings.max_connections)
    server = _SignalAwareServer(uvicorn_config(app, settings, metrics), on_signal)
    serve_task = asyncio.create_task(server.serve())
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.02)
    if serve_task.done():
        serve_task.result()  # re-raises uvicorn's start-up failure
        return 1
    address = _address(server, settings)
    print(f"kvserve {kvserve_version()}: listening on {address}, loading {engine_config.model!r} ...",
          file=out, flush=True)

    loaded = _load_in_thread(engine_factory, engine_config, [metrics, LogStats()])
    stop_wait = asyncio.create_task(stop.wait())
    await asyncio.wait({loaded, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if not loaded.done():  # SIGTERM while loading: nothing in flight, leave now
        server.should_exit = True
        await serve_task
        return 0
    stop_wait.cancel()
    error = loaded.exception()
    if error is not None:
        # A setting that cannot work (e.g. a KV cache that does not fit the memory limit) is a
        # usage error, exit 2 as for bad flags; anything else failed to load, exit 1.
        usage = isinstance(error, ConfigError)
        print(f"kvserve: error: {error}" if usage else f"kvserve: could not load the model: {error}",
              file=sys.stderr, flush=True)
        server.should_exit = True
        await serve_task
        return 2 if usage else 1
    engine = loaded.result()
    # Everything alive now (the model, compiled graphs, torch's and the compiler's objects: about
    # half a million) lives as long as the server. Frozen, the collector stops walking it: each full
    # collection otherwise stalls the engine thread ~180 ms (measured in an offline W64 run).
    gc.collect()
    gc.freeze()
    engine.start()
    state.attach_engine(engine)
    metrics.set_config_info(loaded_metrics_info(engine))
    print(startup_summary(engine, address), file=out, flush=True)

    await asyncio.wait({asyncio.create_task(stop.wait()), serve_task}, return_when=asyncio.FIRST_COMPLETED)
    if not serve_task.done():
        drained = await state.drain(settings.shutdown_grace_period)
        logger.info("drained %s; shutting down", "cleanly" if drained else "after aborting what remained")
        server.should_exit = True
        await serve_task
    engine.shutdown()
    gc.unfreeze()  # for a caller that goes on after the server (tests run it in-process)
    print("kvserve: stopped", file=out, flush=True)
    return 0


def uvicorn_config(app: FastAPI, settings: ServerSettings, listener: ConnectionListener | None = None
                   ) -> uvicorn.Config:
    """uvicorn's settings for `app`, its HTTP protocol guarded (connection cap, header timeout)."""
    limits = ConnectionLimits(settings.max_connections, settings.header_timeout)
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          lifespan="off", timeout_graceful_shutdown=5, access_log=settings.log_level == "debug",
                          http=guarded_protocol(AutoHTTPProtocol, limits, listener))


def _load_in_thread(factory: EngineFactory, config: EngineConfig,
                    listeners: Sequence[StatsListener]) -> asyncio.Future[AsyncEngine]:
    """Loads on a daemon thread (not the default executor, which asyncio.run would wait for),
    so SIGTERM during a long load exits at once."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[AsyncEngine] = loop.create_future()

    def deliver(engine: AsyncEngine | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(engine)  # type: ignore[arg-type]

    def load() -> None:
        try:
            engine = factory(config, listeners)
        except BaseException as error:  # noqa: BLE001 - reported to the serving loop
            loop.call_soon_threadsafe(deliver, None, error)
        else:
            loop.call_soon_threadsafe(deliver, engine, None)

    threading.Thread(target=load, name="kvserve-model-load", daemon=True).start()
    return future


def _address(server: uvicorn.Server, settings: ServerSettings) -> str:
    port = settings.port
    if port == 0 and server.servers and server.servers[0].sockets:
        port = server.servers[0].sockets[0].getsockname()[1]
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{port}"


def metrics_info(config: EngineConfig) -> dict[str, str]:
    """The cache/model info metric as configured; replaced by `loaded_metrics_info` once the
    model has loaded and "auto" values are resolved."""
    return {
        "model": config.model,
        "dtype": config.dtype,
        "kv_dtype": config.kv_cache_dtype,
        "block_size": str(config.block_size),
        "num_blocks": str(config.num_kv_blocks or "auto"),
        "max_model_len": str(config.max_model_len or "auto"),
        "prefix_caching": str(config.enable_prefix_caching).lower(),
    }


def loaded_metrics_info(engine: AsyncEngine) -> dict[str, str]:
    config = engine.config
    dtype = str(engine.dtype).removeprefix("torch.")
    return {
        "model": config.model,
        "dtype": dtype,
        "kv_dtype": dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        "block_size": str(engine.block_size),
        "num_blocks": str(engine.num_kv_blocks),
        "max_model_len": str(engine.max_model_len),
        "prefix_caching": str(config.enable_prefix_caching).lower(),
    }


def startup_summary(engine: AsyncEngine, address: str) -> str:
    blocks_per_request = math.ceil(engine.max_model_len / engine.block_size)
    fit = engine.num_kv_blocks / blocks_per_request
    config = engine.config
    return "\n".join([
        f"kvserve {kvserve_version()} ready: model {config.model_name!r} ({config.model})",
        f"  dtype {str(engine.dtype).removeprefix('torch.')} on {engine.device}; "
        f"max_model_len {engine.max_model_len}; max_num_seqs {config.max_num_seqs}; "
        f"prefix caching {'on' if config.enable_prefix_caching else 'off'}",
        f"  KV cache: {engine.num_kv_blocks} blocks x {engine.block_size} tokens = "
        f"{engine.num_kv_blocks * engine.block_size} tokens, {engine.kv_cache_bytes / 2**20:.1f} MiB; "
        f"{fit:.1f} requests of max_model_len fit at once",
        f"  OpenAI API at {address}/v1 (health: /health, metrics: /metrics)",
    ])


