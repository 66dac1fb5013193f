"""The trainer's side of SGLang's ``update_weights_from_distributed``: the group and the push.

    trainer rank (rank 0 of the group) ──broadcast──> server tp ranks 1 .. tp (one server)
    group = trainer_weight_update_group(addr, port, 1 + tp)   while the servers join it
    push_weights(engine, [(hf_name, full tensor), ...], group, version)

NCCL on GPUs; the same protocol with backend="gloo" runs on CPU. Tensors travel in the order
announced (names, dtypes, shapes first, over HTTP), one broadcast each; the servers load them
under SGLang's begin/end_weight_update session and tag their weights with ``version``, which
every later /generate answer carries (the engine checks it).

The trainer's store listens only where the servers are: ``weight_update_listener(host)`` binds
a socket to that address (loopback for servers on this node) with a port the kernel picks, and
the store serves on it (``listen_socket``), so nothing off the node can join, and no port is
picked, closed and hoped free. Callers pick unpredictable group names (sglang_rollout.py).
"""

from __future__ import annotations

import socket
from concurrent.futures import Future
from typing import Any, Optional, Sequence

from earl_megatron.runtime.fault_points import fault_point


def weight_update_listener(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` (one address, never every interface), port chosen by
    the kernel: pass it as ``listen_socket`` and its port as ``master_port`` (the store takes
    the descriptor over)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen(64)
    return sock


def trainer_weight_update_group(master_address: str, master_port: int, world_size: int,
                                group_name: str = "weight_update_group", backend: str = "nccl",
                                timeout_s: float = 600.0,
                                listen_socket: Optional[socket.socket] = None) -> Any:
    """The trainer's side (rank 0) of the servers' weight-update group, outside the default group.

    The trainer already has its own world (Megatron's); this group joins rank 0 of it with every
    server's TP ranks through a TCP rendezvous at master_address:master_port, the way SGLang's
    /init_weights_update_group joins on its side (a store prefixed with group_name). Call it
    while ``start_init_weights_update_group``'s future is pending. ``listen_socket``
    (``weight_update_listener``): the store serves on it; None: torch binds master_port on
    every interface (tests only).
    """
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    # the store this side hosts, built directly: under torchrun (TORCHELASTIC_USE_AGENT_STORE)
    # c10d.rendezvous would connect to master_port as a client of an agent store instead, and
    # with the server also a client nobody hosts it (a hang, seen here); sglang_server strips
    # the launcher's variables from the servers' environment for the same reason
    if listen_socket is not None:
        try:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=True,
                                  timeout=timeout, master_listen_fd=listen_socket.fileno())
        finally:
            # the store's event loop owns the descriptor now (and closes it with the store):
            # Python must never close it too, or a later socket reusing the number goes
            listen_socket.detach()
    else:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=True,
                              timeout=timeout, multi_tenant=True)
    rank, world = 0, world_size
    # torch has no public API for a group outside the default world; this private helper is
    # what SGLang itself uses, and the store prefix must match its side.
    group, _ = c10d._new_process_group_helper(world, rank, [], dist.Backend(backend),
                                              dist.PrefixStore(group_name, store),
                                              group_name=group_name, timeout=timeout)
    # global rank -> group rank, for torch's own lookups (its error messages ask for this
    # process's group rank): the servers' ranks are not in this process's world, and this
    # process is the group's rank 0 whatever its global rank (a split's rollout leader is
    # global rank 2: {i: i} made a gloo error in a push a ValueError, "Global rank 2 is not
    # part of group", which the engine's restart path did not take)
    me = dist.get_rank() if dist.is_initialized() else 0
    c10d._world.pg_group_ranks[group] = {me: 0}
    return group


def push_weights(engine, named_tensors: Sequence[tuple[str, Any]], group: Any,
                 group_name: str = "weight_update_group",
                 weight_version: Optional[str] = None) -> None:
    """Broadcast HF-named tensors from this process (rank 0 of ``group``) into every server of
    ``engine``. Tensors must be full (gathered), contiguous, on the group's device (cuda for
    NCCL, cpu for gloo), in the order given."""
    import torch.distributed as dist

    from earl_megatron.rollout.sglang_launch import SGLangRequestError

    names = [n for n, _ in named_tensors]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named_tensors]
    shapes = [list(t.shape) for _, t in named_tensors]
    done = engine.start_update_weights_from_distributed(names, dtypes, shapes, group_name,
                                                        weight_version)
    fault_point("sglang.push", pid=engine.server_pids[0], log_dir=str(engine.log_dir),
                version=weight_version)
    for _, tensor in named_tensors:
        if done.done():  # a server refused the update: nobody will receive; fail now
            done.result()
            raise SGLangRequestError("servers finished the update before all tensors were "
                                     "sent (names/shapes out of sync with the tensors?)")
        dist.broadcast(tensor.contiguous(), group=group, group_src=0)
    done.result()


class WeightUpdateGroup:
    """SGLangEngine's side of the group, over its servers (mixed into rollout/sglang_engine.py's
    engine, whose ``_servers``, ``_pool``, ``_post_all`` and ``_check_open`` it uses): join the
    servers' TP ranks to the group, announce a push, broadcast it (``push_weights``); and LoRA
    adapters over the base the servers hold (``load_adapter``)."""

    adapter: Optional[str] = None
    """The LoRA adapter every /generate request asks for (its name is its weight version);
    None: the base alone."""
    _adapter_payload: Optional[dict] = None

    def load_adapter(self, name: str, tensors: dict, config: dict) -> None:
        """Every server loads LoRA adapter ``name`` (``tensors``: PEFT names -> CPU tensors;
        ``config``: its adapter_config.json) in place of the current one, which it unloads
        after (the servers start with two adapter slots); answers then carry ``name`` as their
        weight version and every later request asks for it.

        By value (SGLang's /load_lora_adapter_from_tensors): one pickle per server tp rank,
        tensors inside by value, which SGLang's restricted unpickler reads (torch storages
        through ``torch.load(weights_only=True)``); no file, no shared memory, so the server
        may run another torch than the trainer. A restarted server gets it again
        (``reload_adapter``)."""
        import base64
        import pickle

        self._check_open()
        blob = base64.b64encode(pickle.dumps(
            {k: t.detach().cpu().contiguous() for k, t in tensors.items()}, protocol=4)).decode()
        self._adapter_payload = {"lora_name": name, "config_dict": config,
                                 "serialized_named_tensors": [blob] * self.config.tp_size}
        previous = self.adapter
        self.reload_adapter()
        if previous is not None and previous != name:
            self._post_all("/unload_lora_adapter",
                           [(s, {"lora_name": previous}) for s in self._servers])

    def reload_adapter(self) -> None:
        """The adapter ``load_adapter`` last loaded, into every server (a restarted server holds
        none), tagged as the weight version."""
        if self._adapter_payload is None:
            return
        name = self._adapter_payload["lora_name"]
        self._post_all("/load_lora_adapter_from_tensors",
                       [(s, self._adapter_payload) for s in self._servers])
        self._post_all("/update_weight_version",
                       [(s, {"new_version": name, "abort_all_requests": False})
                        for s in self._servers])
        self.adapter = self.expected_version = name
        for s in self._servers:
            with open(s.log_path, "ab") as log:
                log.write(f"\n=== weight version {name}: adapter loaded "
                          f"({len(self._adapter_payload['serialized_named_tensors'][0])} B "
                          f"per tp rank)\n".encode())

    @property
    def weight_update_world_size(self) -> int:
        """Ranks in the weight-update group: the trainer's rank 0 plus every server TP rank."""
        return 1 + len(self._servers) * self.config.tp_size

    def start_init_weights_update_group(self, master_address: str, master_port: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> Future:
        """Join every server's TP ranks to a process group with the trainer as rank 0.

        World size is 1 + num_servers * tp_size; server i's ranks start at 1 + i * tp_size.
        The servers block until the trainer joins as rank 0 (``trainer_weight_update_group``
        with the same address, port, world size and group name), so this returns a future: start
        it, join, then wait on it.
        """
        self._check_open()
        world = self.weight_update_world_size
        calls = [(s, {"master_address": master_address, "master_port": master_port,
                      "rank_offset": 1 + s.index * self.config.tp_size, "world_size": world,
                      "group_name": group_name, "backend": backend}) for s in self._servers]
        return self._pool.submit(self._post_all, "/init_weights_update_group", calls)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._post_all("/destroy_weights_update_group",
                       [(s, {"group_name": group_name}) for s in self._servers])

    def start_update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: Optional[str] = None) -> Future:
        """Open a weight-update session and announce HF-named tensors, broadcast from rank 0.

        Returns a future; the trainer broadcasts each tensor on the group in the announced order,
        then waits on it (the future also closes the session with /end_weight_update).
        Afterwards the servers' weights exist nowhere on disk: a restarted server needs
        ``on_restart`` to push them again.
        """
        self._check_open()
        self._weights_on_disk = False
        # SGLang 0.5.23 refuses weight pushes outside a begin/end_weight_update session.
        self._post_all("/begin_weight_update", [(s, {}) for s in self._servers])
        payload = {"names": list(names), "dtypes": list(dtypes),
                   "shapes": [list(s) for s in shapes], "group_name": group_name,
                   "flush_cache": True}
        if weight_version is not None:
            payload["weight_version"] = weight_version  # every later /generate answer carries it
            self.expected_version = weight_version
            for s in self._servers:  # the log says which weights each later answer came from
                with open(s.log_path, "ab") as log:
                    log.write(f"\n=== weight version {weight_version}: {len(payload['names'])} "
                              f"tensors pushed\n".encode())

        def update_then_end() -> list[Any]:
            try:
                return self._post_all("/update_weights_from_distributed",
                                      [(s, payload) for s in self._servers])
            finally:
                self._post_all("/end_weight_update", [(s, {}) for s in self._servers])

        return self._pool.submit(update_then_end)

    def push_weights_distributed(self, named_tensors: Sequence[tuple[str, Any]], group: Any,
                                 group_name: str = "weight_update_group",
                                 weight_version: Optional[str] = None) -> None:
        """Broadcast HF-named full tensors from rank 0 of ``group`` (``push_weights``)."""
        push_weights(self, named_tensors, group, group_name, weight_version)
