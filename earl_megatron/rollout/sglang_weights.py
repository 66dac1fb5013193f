"""The trainer's side of SGLang's ``update_weights_from_distributed``: the group and the push.

    trainer rank (rank 0 of the group) ──broadcast──> server tp ranks 1 .. tp (one server)
    group = trainer_weight_update_group(addr, port, 1 + tp)   while the servers join it
    push_weights(engine, [(hf_name, full tensor), ...], group, version)

NCCL on GPUs; the same protocol with backend="gloo" runs on CPU. Tensors travel in the order
announced (names, dtypes, shapes first, over HTTP), one broadcast each; the servers load them
under SGLang's begin/end_weight_update session and tag their weights with ``version``, which
every later /generate answer carries (the engine checks it).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

def trainer_weight_update_group(master_address: str, master_port: int, world_size: int,
                                group_name: str = "weight_update_group", backend: str = "nccl",
                                timeout_s: float = 600.0) -> Any:
    """The trainer's side (rank 0) of the servers' weight-update group, outside the default group.

    The trainer already has its own world (Megatron's); this group joins rank 0 of it with every
    server's TP ranks through a TCP rendezvous at master_address:master_port, the way SGLang's
    /init_weights_update_group joins on its side (a store prefixed with group_name). Call it
    while ``start_init_weights_update_group``'s future is pending.
    """
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    # the store this side hosts, built directly: under torchrun (TORCHELASTIC_USE_AGENT_STORE)
    # c10d.rendezvous would connect to master_port as a client of an agent store instead, and
    # with the server also a client nobody hosts it (a hang, seen here); sglang_server strips
    # the launcher's variables from the servers' environment for the same reason
    store = dist.TCPStore(master_address, master_port, world_size, is_master=True,
                          timeout=timeout, multi_tenant=True)
    rank, world = 0, world_size
    # torch has no public API for a group outside the default world; this private helper is
    # what SGLang itself uses, and the store prefix must match its side.
    group, _ = c10d._new_process_group_helper(world, rank, [], dist.Backend(backend),
                                              dist.PrefixStore(group_name, store),
                                              group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def push_weights(engine, named_tensors: Sequence[tuple[str, Any]], group: Any,
                 group_name: str = "weight_update_group",
                 weight_version: Optional[str] = None) -> None:
    """Broadcast HF-named tensors from this process (rank 0 of ``group``) into every server of
    ``engine``. Tensors must be full (gathered), contiguous, on the group's device (cuda for
    NCCL, cpu for gloo), in the order given."""
    import torch.distributed as dist

    from earl_megatron.rollout.sglang_server import SGLangRequestError

    names = [n for n, _ in named_tensors]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named_tensors]
    shapes = [list(t.shape) for _, t in named_tensors]
    done = engine.start_update_weights_from_distributed(names, dtypes, shapes, group_name,
                                                        weight_version)
    for _, tensor in named_tensors:
        if done.done():  # a server refused the update: nobody will receive; fail now
            done.result()
            raise SGLangRequestError("servers finished the update before all tensors were "
                                     "sent (names/shapes out of sync with the tensors?)")
        dist.broadcast(tensor.contiguous(), group=group, group_src=0)
    done.result()
