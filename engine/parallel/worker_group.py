"""Rank 0's side of tensor parallelism: the worker processes, and the runner that sends each
step to them before running its own shard.

Start-up fails with the worker's traceback if a worker cannot build its shard; a worker that
dies later fails the next step with WorkerDiedError (the engine then reports itself dead), and
never leaves rank 0 waiting: its process is checked before each step, its pipe breaks, and a
collective with a missing peer errors out after COLLECTIVE_TIMEOUT at worst.
"""

from __future__ import annotations

import multiprocessing
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.model.llama import LlamaForCausalLM
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.parallel.layers import shard_model
from kvserve.engine.parallel.process_group import (
    check_devices, free_loopback_port, join_group, leave_group, rank_device,
)
from kvserve.engine.parallel.sharding import rank_model_config
from kvserve.engine.parallel.worker import WorkerSpec, worker_main
from kvserve.engine.structured_output import TokenMask
from kvserve.kernels import AttentionBackend
from kvserve.paging import KVCacheConfig
from kvserve.scheduler.output import ModelRunnerOutput, SchedulerOutput

WORKER_START_TIMEOUT_S = 600.0  # spawn + import torch + load and shard the weights
WORKER_STOP_TIMEOUT_S = 10.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited or could not start."""


class _Worker:
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


class WorkerGroup:
    """Ranks 1..N-1 as spawned processes (spawn, not fork: the engine process has threads)."""

    def __init__(self, workers: list[_Worker]) -> None:
        self._workers = workers
        self._finalizer = weakref.finalize(self, _stop, workers)

    @classmethod
    def spawn(cls, specs: list[WorkerSpec]) -> "WorkerGroup":
        context = multiprocessing.get_context("spawn")
        workers = []
        for spec in specs:
            steps_out, steps_in = context.Pipe(duplex=False)
            status_out, status_in = context.Pipe(duplex=False)
            process = context.Process(target=worker_main, args=(spec, steps_out, status_in), daemon=True,
                                      name=f"kvserve-tp-worker-{spec.rank}")
            process.start()
            steps_out.close()
            status_in.close()
            workers.append(_Worker(process, steps_in, status_out, spec.rank))
        return cls(workers)

    @property
    def processes(self) -> tuple[BaseProcess, ...]:
        return tuple(worker.process for worker in self._workers)

    def wait_for(self, state: str) -> None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        for worker in self._workers:
            worker.wait_for(state, deadline)

    def send(self, output: SchedulerOutput) -> None:
        for worker in self._workers:
            if not worker.process.is_alive():
                raise WorkerDiedError(f"tensor-parallel worker {worker.rank} exited with code {worker.process.exitcode}")
            try:
                worker.steps.send(output)
            except (BrokenPipeError, ConnectionResetError, OSError) as error:
                raise WorkerDiedError(f"tensor-parallel worker {worker.rank} is gone: {error}") from error

    def stop(self) -> None:
        self._finalizer()


def _stop(workers: list[_Worker]) -> None:
    for worker in workers:
        try:
            worker.steps.send(None)
        except OSError:
            pass  # already gone
    deadline = time.monotonic() + WORKER_STOP_TIMEOUT_S
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(5)
        worker.steps.close()
        worker.status.close()


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: sends each step to the workers, then runs its own shard (whose row-
    parallel layers meet the workers' in all_reduce). Its samples are the engine's."""

    @classmethod
    def start(cls, config: EngineConfig, source: ModelSource, model: LlamaForCausalLM, model_config: ModelConfig,
              num_kv_blocks: int, kv_dtype: torch.dtype, attention: AttentionBackend, device: torch.device,
              dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> "TensorParallelRunner":
        """`model` is rank 0's fully loaded model; it is sharded in place."""
        world_size = config.tensor_parallel_size
        rank_model_config(model_config, world_size)  # clear errors before any process starts
        check_devices(device, world_size)
        port = free_loopback_port()
        # On CPU the ranks share the cores the engine was given: each takes its share of threads.
        threads = max(1, torch.get_num_threads() // world_size) if device.type == "cpu" else torch.get_num_threads()
        torch.set_num_threads(threads)
        specs = [WorkerSpec(config, source, str(device), dtype, num_kv_blocks, threads, rank, world_size, port)
                 for rank in range(1, world_size)]
        workers = WorkerGroup.spawn(specs)
        try:
            workers.wait_for("started")
            group = join_group(rank_device(device, 0), 0, world_size, port)
            shard_model(model, model_config, 0, world_size, group)
            from kvserve.engine.engine_builder import kv_cache_config_for  # the builder imports this module

            kv_cache_config = kv_cache_config_for(model, num_kv_blocks, config.block_size, kv_dtype)
            runner = cls(model, rank_model_config(model_config, world_size), kv_cache_config, kv_dtype, attention,
                         device, eos_token_ids, workers)
            workers.wait_for("ready")
        except BaseException:
            workers.stop()
            leave_group()
            raise
        return runner

    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, kv_cache_config: KVCacheConfig,
                 kv_dtype: torch.dtype, attention: AttentionBackend, device: torch.device,
                 eos_token_ids: tuple[int, ...], workers: WorkerGroup) -> None:
        super().__init__(model, model_config, kv_cache_config, kv_dtype, attention, device, eos_token_ids)
        self.workers = workers

    def execute(self, output: SchedulerOutput, token_mask: TokenMask | None = None) -> ModelRunnerOutput:
        """Workers sample too, unmasked, and their tokens are discarded: the structured-output mask
        applies after the step's last collective, so only rank 0 needs it."""
        self.workers.send(output)
        return super().execute(output, token_mask)

    def close(self) -> None:
        self.workers.stop()
        leave_group()
