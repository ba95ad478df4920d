"""The real engine over the tiny random checkpoint, behind the real app on a live port: for
tests of what real clients send (issue 13) that need real logits, not the fake engine's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.config import EngineConfig
from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.live_server import live_server
from tests.server.tiny_checkpoint import write_tiny_checkpoint

MODEL = "tiny"


@dataclass(frozen=True)
class TinyServer:
    url: str
    engine: AsyncEngine
    checkpoint: Path


@contextmanager
def tiny_server(folder: Path, settings: ServerSettings | None = None, model: Path | None = None,
                **engine_options: object) -> Iterator[TinyServer]:
    """`model` serves another checkpoint (e.g. the default model) the same way."""
    checkpoint = model or write_tiny_checkpoint(folder / "tiny")
    options = {"num_kv_blocks": 96, "max_model_len": 512, **engine_options}
    config = EngineConfig(model=str(checkpoint), served_model_name=MODEL, dtype="float32", device="cpu", **options)
    engine = AsyncEngine.from_config(config)
    engine.start()
    try:
        with live_server(build_app(engine, settings or ServerSettings())) as url:
            yield TinyServer(url, engine, checkpoint)
    finally:
        engine.shutdown()
