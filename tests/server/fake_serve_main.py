"""`python -m tests.server.fake_serve_main GRACE_S`: the real `run_server` lifecycle (signals,
drain, exit code) over the fake engine, so the graceful-shutdown test needs no model."""

from __future__ import annotations

import sys

from kvserve.engine.config import EngineConfig
from kvserve.server.serve import run_server
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL, FakeEngine


def main() -> int:
    settings = ServerSettings(port=0, shutdown_grace_period=float(sys.argv[1]), log_level="warning")
    return run_server(EngineConfig(model=MODEL), settings,
                      engine_factory=lambda config, listeners: FakeEngine(step_delay=0.02, max_model_len=4096))


if __name__ == "__main__":
    sys.exit(main())
