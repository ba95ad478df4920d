"""torch.distributed set-up for one tensor-parallel group on one machine."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

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
    """Rank r computes on cuda:r (one GPU per rank); on CPU every rank uses the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


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
