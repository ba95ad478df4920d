"""torch.distributed set-up for one tensor-parallel group on one machine."""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from kvserve.engine.config import ConfigError
from kvserve.engine.model.tensor_parallel import TensorParallel

T = TypeVar("T")

# A collective waits at most this long for its peers. Ranks run each step in lockstep, so a wait
# this long means a peer is gone; it turns a would-be hang into an error.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """On CUDA rank r computes on the r-th GPU from rank 0's (cuda:1 with N=2: cuda:1 and cuda:2);
    on CPU every rank uses the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(device: torch.device, world_size: int) -> None:
    if device.type == "cuda" and (device.index or 0) + world_size > torch.cuda.device_count():
        raise ConfigError("--tensor-parallel-size",
                          f"--tensor-parallel-size {world_size} needs one GPU per rank from {device}, "
                          f"but {torch.cuda.device_count()} are visible")


def join_group(device: torch.device, rank: int, world_size: int, port: int) -> dist.ProcessGroup:
    """Joins the default process group (rank 0 hosts its store on 127.0.0.1:port)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    group = dist.group.WORLD
    assert group is not None
    return group


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def reduce_int(value: int, op: dist.ReduceOp, parallel: TensorParallel, device: torch.device) -> int:
    """`value` combined over the ranks of `parallel` (every rank must call it): a block count's
    minimum, a byte count's sum. A single rank gets its own value back."""
    if not parallel.is_sharded:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=op, group=parallel.group)
    return int(tensor.item())


class PeerFailedError(RuntimeError):
    """Another tensor-parallel rank failed a step that every rank takes together."""


def on_every_rank(parallel: TensorParallel, device: torch.device, work: Callable[[], T]) -> T:
    """Runs `work` (a step that may fail on one rank only: reading its slice of the weights); if
    it failed on any rank, every rank raises (a failed rank its own error), instead of the others
    waiting in their next collective for a peer that never comes."""
    try:
        result, error = work(), None
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the peers know
        result, error = None, exc
    failed = reduce_int(int(error is not None), dist.ReduceOp.MAX, parallel, device)
    if error is not None:
        raise error
    if failed:
        raise PeerFailedError("another tensor-parallel rank failed while building its shard; its error is reported by that rank")
    return result  # type: ignore[return-value]
