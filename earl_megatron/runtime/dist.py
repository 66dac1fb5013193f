"""Initialise torch.distributed from torchrun's environment, with one backend rule for every host.

The world is created with the backend string ``world_backend`` gives:

    host with GPUs:  "cpu:gloo,cuda:nccl"   CUDA tensors over NCCL, CPU tensors over gloo
    CPU-only host:   "gloo"                 every tensor over gloo (torch maps cpu and cuda to it)

Every group made with ``new_group(backend=None)`` inherits that string (Megatron-Core's tp, pp,
cp and dp groups included), so a collective on CPU data (the stop agreement, the rollout
replicas' agreements, small metadata all-reduces) is legal on every group of every host: on a
GPU host a plain "nccl" world would refuse them. Test code initialises through
``init_distributed`` too (testing/multiproc.py), and the trainer records the string in
``<run>/world.json``. Why not "cpu:gloo" on CPU hosts: torch 2.13 gives a device-mapped group
without NCCL no default backend type once any backend plugin is registered (importing
Megatron-Core registers torch's "fake" one), and such a group warns at destruction and fails
calls that need the default backend; with NCCL in the string, or a plain name, it has one.

``init_distributed`` is idempotent, binds each rank to its local GPU when there is one, and uses
the configured collective timeout (``cluster.collective_timeout_s``), so a mismatched collective
fails in minutes rather than after gloo's default 30.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.config.cluster import ClusterConfig


def world_backend(cuda: Optional[bool] = None) -> str:
    """The device-mapped backend string of the world (None: ask this host)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def device_backends(group=None) -> dict[str, str]:
    """{device type: backend} of ``group`` (None: the world): {"cpu": "gloo", "cuda": "nccl"}
    on a GPU host, {"cpu": "gloo"} on a CPU-only one."""
    text = str(dist.get_backend(group)).replace(" ", "")
    if ":" not in text:   # a single backend, e.g. a group made with backend="gloo"
        return {"cuda" if text == "nccl" else "cpu": text}
    return dict(entry.split(":", 1) for entry in text.split(","))


def gloo_only(group=None) -> bool:
    """Whether every collective of ``group`` (None: the world) runs over gloo: a CPU-only host.
    What gloo-specific economies key on (one group per rank list, no extra gloo groups,
    same-host shared memory), never the backend's name."""
    return set(device_backends(group).values()) == {"gloo"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (rendezvous of a 1-process world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = ClusterConfig.collective_timeout_s,
                     backend: Optional[str] = None) -> tuple[int, int]:
    """(rank, world_size); a single process without torchrun gets a 1-rank world. ``backend``
    (``cluster.world_backend``) replaces the host's rule, e.g. "gloo" for several ranks on one
    GPU (NCCL refuses two ranks on one device)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = torch.cuda.is_available()
    if cuda:   # ranks beyond the node's GPUs share them (possible over gloo only)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend or world_backend(cuda),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def world_record() -> dict:
    """What the trainer writes to ``<run>/world.json``: the backend string actually in force."""
    return {"backend": dist.get_backend(), "devices": device_backends(),
            "world_size": dist.get_world_size(),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
            "cuda": torch.cuda.is_available()}


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
