"""The seam between the step loop and the ranks that run the model.

    LLMEngine.step:  scheduler.schedule() -> executor.execute(SchedulerOutput, token_mask)
                         -> ModelRunnerOutput -> scheduler.update_from_output(...)

An executor owns every rank's Worker: UniprocExecutor the one in this process, MultiprocExecutor
rank 0 here and ranks 1..N-1 in worker processes (tensor parallelism). Either way `driver` is the
Worker in this process, whose runner's samples are the engine's; its KV cache spec is every rank's.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.engine.executor.multiproc_executor import MultiprocExecutor
from kvserve.engine.executor.uniproc_executor import UniprocExecutor
from kvserve.engine.structured_output.token_mask import TokenMask
from kvserve.engine.worker import Worker, WorkerSpec
from kvserve.scheduler.output import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    driver: Worker

    def execute(self, output: SchedulerOutput, token_mask: TokenMask | None = None) -> ModelRunnerOutput: ...

    def close(self) -> None:
        """Stops the worker processes, if any; the executor cannot run steps afterwards."""


def executor_for(spec: WorkerSpec) -> Executor:
    """spec: rank 0's (its world_size says how many ranks)."""
    return UniprocExecutor(spec) if spec.world_size == 1 else MultiprocExecutor(spec)
