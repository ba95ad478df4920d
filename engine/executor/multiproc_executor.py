"""Tensor parallelism: rank 0 in the engine process, ranks 1..N-1 in worker processes, each one
built by Worker.build with its slice of every weight and of the KV cache (its KV heads).

    rank 0 (the engine process)                  ranks 1..N-1 (worker processes)
    scheduler.schedule() -> SchedulerOutput ──pipe──► same SchedulerOutput
    driver.execute(output)                        worker.execute(output)
      vocab-parallel embedding ── all_reduce ─────── all_reduce
      column-parallel qkv / gate_up (no comm)       (same layers, other shards)
      row-parallel o / down ── all_reduce ──────────── all_reduce
      vocab-parallel lm_head ── all_gather ──────────── all_gather
    sampled tokens -> scheduler                   (result discarded)

Collectives use torch.distributed: gloo on CPU, NCCL on CUDA. The plain-data SchedulerOutput is
sent to the workers over pipes rather than a collective, so an idle engine (workers waiting for
work) never trips a collective timeout, and a dead worker shows up as a closed pipe or a dead
process before the step's first all_reduce. The structured-output mask applies after the step's
last collective (to the gathered logits), so only rank 0 needs it.
"""

from __future__ import annotations

import dataclasses
from multiprocessing.process import BaseProcess

import torch

from kvserve.engine.parallel.process_group import PeerFailedError, check_devices, free_loopback_port, leave_group
from kvserve.engine.parallel.worker_processes import WorkerDiedError, WorkerProcesses
from kvserve.engine.structured_output.token_mask import TokenMask
from kvserve.engine.worker import Worker, WorkerSpec
from kvserve.scheduler.output import ModelRunnerOutput, SchedulerOutput

# How long rank 0 waits for a worker's own error after its build failed because a peer's did.
PEER_ERROR_WAIT_S = 30.0


class MultiprocExecutor:
    def __init__(self, spec: WorkerSpec) -> None:
        """spec: rank 0's; world_size > 1."""
        if spec.world_size < 2 or spec.rank != 0:
            raise ValueError("MultiprocExecutor starts from rank 0's spec of a group of two or more ranks")
        check_devices(torch.device(spec.device), spec.world_size)
        spec = dataclasses.replace(spec, port=free_loopback_port())
        self.workers = WorkerProcesses.spawn([dataclasses.replace(spec, rank=rank)
                                              for rank in range(1, spec.world_size)])
        try:
            self.workers.wait_for("started")
            try:
                self.driver = Worker.build(spec)
            except PeerFailedError:
                self.workers.wait_for("ready", PEER_ERROR_WAIT_S)  # raises the failed worker's own traceback
                raise
            self.workers.wait_for("ready")
        except BaseException:
            self.workers.stop()
            leave_group()
            raise

    @property
    def processes(self) -> tuple[BaseProcess, ...]:
        return self.workers.processes

    def execute(self, output: SchedulerOutput, token_mask: TokenMask | None = None) -> ModelRunnerOutput:
        self.workers.send(output)
        return self.driver.execute(output, token_mask)

    def close(self) -> None:
        self.workers.stop()
        self.driver.close()


__all__ = ["MultiprocExecutor", "WorkerDiedError"]
