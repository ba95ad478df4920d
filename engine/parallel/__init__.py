"""Tensor parallelism: N processes each hold 1/N of every attention head group, MLP column and
vocabulary row, and 1/N of the paged KV cache (their KV heads); rank 0 also runs the scheduler.

    rank 0 (the engine process)                  ranks 1..N-1 (worker processes)
    scheduler.schedule() -> SchedulerOutput ──pipe──► same SchedulerOutput
    runner.execute(output)                        runner.execute(output)
      vocab-parallel embedding ── all_reduce ─────── all_reduce
      column-parallel qkv / gate_up (no comm)       (same layers, other shards)
      row-parallel o / down ── all_reduce ──────────── all_reduce
      vocab-parallel lm_head ── all_gather ──────────── all_gather
    sampled tokens -> scheduler                   (result discarded)

Collectives use torch.distributed: gloo on CPU, NCCL on CUDA. The plain-data SchedulerOutput is
sent to the workers over pipes rather than a collective, so an idle engine (workers waiting for
work) never trips a collective timeout, and a dead worker shows up as a closed pipe or a dead
process before the step's first all_reduce.
"""

from kvserve.engine.parallel.sharding import check_tensor_parallel, rank_model_config
from kvserve.engine.parallel.worker_group import TensorParallelRunner, WorkerDiedError, WorkerGroup

__all__ = ["TensorParallelRunner", "WorkerDiedError", "WorkerGroup", "check_tensor_parallel", "rank_model_config"]
