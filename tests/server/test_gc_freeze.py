"""`kvserve serve` freezes the objects alive once the model is loaded (the collector then stops
walking the model's half a million objects on every full collection) and thaws them when it
returns, so an in-process caller is left with the collector as it found it."""

from __future__ import annotations

import gc
import io
import os
import signal

from kvserve.engine.config import EngineConfig
from kvserve.server.serve import run_server
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL, FakeEngine


class _EngineThatStopsTheServer(FakeEngine):
    """Records what the collector had frozen when the server started it, then asks the server
    to stop as SIGTERM would (the server's own signal handler takes it)."""

    frozen_at_start: int | None = None

    def start(self) -> None:
        super().start()
        type(self).frozen_at_start = gc.get_freeze_count()
        os.kill(os.getpid(), signal.SIGTERM)


def test_objects_alive_at_start_are_frozen_while_serving_and_thawed_after() -> None:
    assert gc.get_freeze_count() == 0
    settings = ServerSettings(port=0, shutdown_grace_period=1.0, log_level="warning")
    code = run_server(EngineConfig(model=MODEL), settings,
                      engine_factory=lambda config, listeners: _EngineThatStopsTheServer(max_model_len=4096),
                      out=io.StringIO())
    assert code == 0
    assert _EngineThatStopsTheServer.frozen_at_start is not None
    assert _EngineThatStopsTheServer.frozen_at_start > 1000  # the test process's modules at least
    assert gc.get_freeze_count() == 0
