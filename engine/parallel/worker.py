"""A tensor-parallel worker process (ranks 1..N-1): joins the group, builds its shard of the
model and KV cache, then runs every SchedulerOutput that rank 0 sends until told to stop.

    status pipe:  ("started", None) -> ("ready", None)   or   ("error", message)
    steps pipe:   SchedulerOutput, ..., None (stop)
"""

from __future__ import annotations

import multiprocessing
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.engine_builder import attention_backend, kv_cache_config_for, kv_cache_dtype
from kvserve.engine.model.model_loader import load_model
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.parallel.layers import shard_model
from kvserve.engine.parallel.process_group import join_group, leave_group, rank_device
from kvserve.engine.parallel.sharding import rank_model_config

PARENT_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, picklable: rank 0 has already resolved device, dtype and the
    number of KV blocks, which every rank must share."""

    config: EngineConfig
    source: ModelSource
    device: str
    dtype: torch.dtype
    num_kv_blocks: int
    cpu_threads: int  # torch intra-op threads of this rank (the ranks share the machine's cores)
    rank: int
    world_size: int
    port: int


def worker_main(spec: WorkerSpec, steps: Connection, status: Connection) -> None:
    status.send(("started", None))
    torch.set_num_threads(spec.cpu_threads)
    try:
        device = rank_device(torch.device(spec.device), spec.rank)
        group = join_group(device, spec.rank, spec.world_size, spec.port)
        runner = _build_runner(spec, device, group)
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
            runner.execute(output)  # its samples are rank 0's too; only rank 0's are used
    finally:
        leave_group()


def _build_runner(spec: WorkerSpec, device: torch.device, group: torch.distributed.ProcessGroup) -> ModelRunner:
    model_config, model = load_model(spec.source, spec.dtype, device)
    shard_model(model, model_config, spec.rank, spec.world_size, group)
    kv_dtype = kv_cache_dtype(spec.config, spec.dtype)
    kv_cache_config = kv_cache_config_for(model, spec.num_kv_blocks, spec.config.block_size, kv_dtype)
    # Sampling happens on every rank from identical logits (lm_head is whole everywhere); only
    # rank 0's result is used, so the end-of-generation ids do not matter here.
    return ModelRunner(model, rank_model_config(model_config, spec.world_size), kv_cache_config, kv_dtype,
                       attention_backend(spec.config, device), device, ())
