"""Initialise torch.distributed from torchrun's environment (gloo on CPU, NCCL on GPUs).

``init_distributed`` is idempotent, picks the backend from the host (cpu_backend.device_backend),
binds each rank to its local GPU when there is one, and uses a short collective timeout so a
mismatched collective fails in minutes, not gloo's default 30.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from earl_megatron.runtime.cpu_backend import device_backend


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (rendezvous of a 1-process world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 300.0) -> tuple[int, int]:
    """(rank, world_size); a single process without torchrun gets a 1-rank group."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    device, backend = device_backend()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
