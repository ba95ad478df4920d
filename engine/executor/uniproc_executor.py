"""One rank, in the engine process."""

from __future__ import annotations

from kvserve.engine.structured_output.token_mask import TokenMask
from kvserve.engine.worker import Worker, WorkerSpec
from kvserve.scheduler.output import ModelRunnerOutput, SchedulerOutput


class UniprocExecutor:
    def __init__(self, spec: WorkerSpec) -> None:
        if spec.world_size != 1:
            raise ValueError(f"UniprocExecutor runs one rank, not {spec.world_size}")
        self.driver = Worker.build(spec)

    def execute(self, output: SchedulerOutput, token_mask: TokenMask | None = None) -> ModelRunnerOutput:
        return self.driver.execute(output, token_mask)

    def close(self) -> None:
        self.driver.close()
