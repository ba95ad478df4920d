"""`python -m tests.soak.soak_server_main MODEL_DIR PORT FAULT_FILE GRACE_S`: the real `kvserve
serve` lifecycle (run_server: signals, drain, exit code) over the real engine, with one test-only
addition: while FAULT_FILE exists, every model step raises, which is how the soak injects an
exception inside a model step into a server process."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from kvserve.engine import AsyncEngine, EngineConfig
from kvserve.engine.stats import StatsListener
from kvserve.server.serve import run_server
from kvserve.server.settings import ServerSettings


class InjectedFault(RuntimeError):
    """Raised inside the model step while the fault file exists."""


def faulty_engine_factory(fault_file: Path):
    def build(config: EngineConfig, listeners: Sequence[StatsListener]) -> AsyncEngine:
        engine = AsyncEngine.from_config(config, listeners)
        runner = engine.engine.executor.driver.runner
        execute = runner.execute

        def execute_or_fail(scheduler_output):
            if fault_file.exists():
                raise InjectedFault("injected fault inside a model step")
            return execute(scheduler_output)

        runner.execute = execute_or_fail
        return engine

    return build


def main() -> int:
    model, port, fault_file, grace_s = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
    # bfloat16, as --dtype auto serves on CPU: the linear layers then run on oneDNN's packed
    # kernels, whose per-shape caches are what the soak's memory bound watches.
    config = EngineConfig(model=model, served_model_name="tiny", dtype="bfloat16", device="cpu",
                          num_kv_blocks=256, max_model_len=512, max_num_seqs=16)
    settings = ServerSettings(host="127.0.0.1", port=port, shutdown_grace_period=grace_s, log_level="warning",
                              max_queued_requests=64)
    return run_server(config, settings, engine_factory=faulty_engine_factory(fault_file))


if __name__ == "__main__":
    sys.exit(main())
