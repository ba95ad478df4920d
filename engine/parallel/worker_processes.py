"""Tensor-parallel ranks 1..N-1 as spawned processes (spawn, not fork: the engine process has
threads). Each builds itself with Worker.build and then runs every SchedulerOutput rank 0 sends.

    status pipe:  ("started", None) -> ("ready", None)   or   ("error", traceback)
    steps pipe:   SchedulerOutput, ..., None (stop)

Start-up fails with the worker's traceback if a worker cannot build its shard; a worker that
dies later fails the next step with WorkerDiedError and never leaves rank 0 waiting: its process
is checked before each step, its pipe breaks, and a collective with a missing peer errors out
after COLLECTIVE_TIMEOUT at worst.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from kvserve.scheduler.output import SchedulerOutput
from kvserve.engine.worker import Worker, WorkerSpec

WORKER_START_TIMEOUT_S = 600.0  # spawn + import torch + load the shard + compile
WORKER_STOP_TIMEOUT_S = 10.0
PARENT_CHECK_INTERVAL_S = 1.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited or could not start."""


def worker_main(spec: WorkerSpec, steps: Connection, status: Connection) -> None:
    status.send(("started", None))
    try:
        worker = Worker.build(spec)
    except BaseException:  # noqa: BLE001 - reported to rank 0, which fails the engine's start
        status.send(("error", traceback.format_exc()))
        return
    status.send(("ready", None))
    parent = multiprocessing.parent_process()
    try:
        while True:
            if not steps.poll(PARENT_CHECK_INTERVAL_S):
                if parent is not None and not parent.is_alive():
                    return  # rank 0 is gone: nobody will send work or take part in collectives
                continue
            try:
                output = steps.recv()
            except EOFError:
                return
            if output is None:
                return
            worker.execute(output)  # its samples equal rank 0's (the logits are gathered); rank 0's are used
    finally:
        worker.close()


class _Process:
    def __init__(self, process: BaseProcess, steps: Connection, status: Connection, rank: int) -> None:
        self.process, self.steps, self.status, self.rank = process, steps, status, rank

    def wait_for(self, state: str, deadline: float) -> None:
        while not self.status.poll(0.2):
            if not self.process.is_alive():
                raise WorkerDiedError(f"tensor-parallel worker {self.rank} exited with code "
                                      f"{self.process.exitcode} while starting")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"tensor-parallel worker {self.rank} did not start in {WORKER_START_TIMEOUT_S:.0f} s")
        kind, detail = self.status.recv()
        if kind == "error":
            raise WorkerDiedError(f"tensor-parallel worker {self.rank} failed to start:\n{detail}")
        if kind != state:
            raise WorkerDiedError(f"tensor-parallel worker {self.rank} said {kind!r}, expected {state!r}")


class WorkerProcesses:
    def __init__(self, processes: list[_Process]) -> None:
        self._processes = processes
        self._finalizer = weakref.finalize(self, _stop, processes)

    @classmethod
    def spawn(cls, specs: list[WorkerSpec]) -> "WorkerProcesses":
        context = multiprocessing.get_context("spawn")
        processes = []
        for spec in specs:
            steps_out, steps_in = context.Pipe(duplex=False)
            status_out, status_in = context.Pipe(duplex=False)
            process = context.Process(target=worker_main, args=(spec, steps_out, status_in), daemon=True,
                                      name=f"kvserve-tp-worker-{spec.rank}")
            process.start()
            steps_out.close()
            status_in.close()
            processes.append(_Process(process, steps_in, status_out, spec.rank))
        return cls(processes)

    @property
    def processes(self) -> tuple[BaseProcess, ...]:
        return tuple(p.process for p in self._processes)

    def wait_for(self, state: str, timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.wait_for(state, deadline)

    def send(self, output: SchedulerOutput) -> None:
        for p in self._processes:
            if not p.process.is_alive():
                raise WorkerDiedError(f"tensor-parallel worker {p.rank} exited with code {p.process.exitcode}")
            try:
                p.steps.send(output)
            except (BrokenPipeError, ConnectionResetError, OSError) as error:
                raise WorkerDiedError(f"tensor-parallel worker {p.rank} is gone: {error}") from error

    def stop(self) -> None:
        self._finalizer()


def _stop(processes: list[_Process]) -> None:
    for p in processes:
        try:
            p.steps.send(None)
        except OSError:
            pass  # already gone
    deadline = time.monotonic() + WORKER_STOP_TIMEOUT_S
    for p in processes:
        p.process.join(max(0.0, deadline - time.monotonic()))
        if p.process.is_alive():
            p.process.kill()
            p.process.join(5)
        p.steps.close()
        p.status.close()
