"""`python -m tests.router.fake_kvserve serve --host H --port P [...]`: the real `run_server`
over the fake engine, standing in for `kvserve` where a test needs replica processes but no
model (deploy/router/run_local.sh's test)."""

from __future__ import annotations

import argparse
import sys

from kvserve.engine.config import EngineConfig
from kvserve.server.serve import run_server
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL, FakeEngine


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    settings = ServerSettings(host=args.host, port=args.port, shutdown_grace_period=5, log_level="warning")
    return run_server(EngineConfig(model=MODEL), settings,
                      engine_factory=lambda config, listeners: FakeEngine(max_model_len=4096))


if __name__ == "__main__":
    sys.exit(main())
