"""SGLang servers on explicit ranks: one server per rollout dp replica, started in a rollout
layout, fed the trainer's weights in versioned buckets, restarted when they die. Where the
weights come from (the policy on these ranks, or a handoff from another pool) is the caller's
business (trainer/sglang_rollout.py's weight sources): nothing here knows the placement.

    rollout layout tp2 x dp2 on ranks (r0, r1, r2, r3) (the world colocated; a rollout pool
    under split placement), pp = cp = 1 (the selector offers nothing else for this engine):

    ranks      r0 r1 | r2 r3          replica d = ranks[d*tp .. d*tp + tp-1] (one node)
    replica       0  |    1
    leader     r0    | r2             the replica's first rank owns its server
    server     :p0 tp2 (GPUs 0,1) | :p1 tp2 (GPUs 2,3)     ports published to every rank

Invariants:
- Every collective here runs on the servers' ranks (``ranks_group``; None: the world's), and
  every one of those ranks calls it; a replica has no group of its own (``from_leader``).
- No answer is used from weights other than the last push's: each push carries a weight version
  (``it<k>``, k = pushes so far), only its last bucket tags it, every /generate answer carries the
  server's version and the engine raises on a mismatch.
- Only leaders hold weights: ``push`` gets (index, count, HF bucket or None) per bucket, a leader
  its buckets, every other rank None (it sent its shards, or received nothing).
- Servers start from the model's config.json alone (``--load-format dummy``): nothing of the
  model's size is built or written before they start; ``fresh`` until the first push.
- LoRA (``model.lora``): servers start with adapters on; a push to fresh servers brings the
  frozen base (untagged) and the adapters, every later push the adapters alone (the caller
  plans them so: ``adapters_only``); each push's adapters are loaded as adapter
  ``it<version>`` by value (rollout/sglang_weights.py ``load_adapter``), which tags the
  answers; a restarted server gets the base, then that adapter.
- A server that dies or stalls is restarted by SGLangEngine's supervision wherever it fails: in
  a rollout request, during a weight push, while the weight-update group forms, or while it
  starts. ``_repush`` rejoins a new group and re-pushes what the server must hold (the leader
  keeps the current push's HF buckets in host memory, ``last_push``; a push cut short is
  replayed up to where it stopped and then continues). The budget of all this is the cluster's
  server_* and weight_sync_timeout_s keys, checked against collective_timeout_s (config).
- The weight-update group's store listens on the servers' address only (loopback), on a port
  the kernel picked for it, under a random name.
- Servers are stopped by their process group on ``stop()``, at exit, and when a layout changes.
- ``shares_device`` (the servers share their GPUs with a policy, cuda only): memory saver on,
  the servers' memory released after a rollout (``release``) and resumed before the next
  request or push; otherwise they own their devices and never release.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.rollout_rules import rollout_layout_problem
from earl_megatron.runtime.fault_points import fault_point
from earl_megatron.weights.peft_export import PEFT_PREFIX, adapter_config, target_modules


def server_ep(model: ModelConfig, layout: ParallelLayout, device: str) -> int:
    """A server's ``--ep-size`` in rollout layout ``layout``: of an MoE model on cuda, the
    layout's expert parallelism as far as it fits in one server's tp ranks (SGLang takes a
    server's ep from them: ep must divide tp), gcd(ep, tp); 1 for dense models and on cpu
    (SGLang 0.5.23's token dispatcher asks for an accelerator when ep > 1: docs/sglang.md), where
    a tp > 1 server splits every expert tp ways instead. The servers' (tp, dp) alone decides a
    restart: ep only shapes how a server splits its experts, not what it serves."""
    if not model.is_moe or device == "cpu":
        return 1
    return math.gcd(layout.ep, layout.tp)


def replica_leaders(layout: ParallelLayout, ranks: Sequence[int]) -> tuple[int, ...]:
    """The global rank of each rollout replica's first rank, replica order: ``ranks`` are the
    servers' ranks, rank ``ranks[i]`` being the layout's rank i."""
    return tuple(ranks[min(i for i in range(layout.world_size) if layout.coords(i).dp == d)]
                 for d in range(layout.dp))


class SGLangServers:
    """The servers of ``ranks`` (global ranks, in the rollout layout's order), their collectives
    on ``ranks_group`` (module docstring)."""

    def __init__(self, model: ModelConfig, *, python: str, device: str, out_dir: Path,
                 ranks: Sequence[int], ranks_group, shares_device: bool,
                 mem_fraction: float, kv_tokens: Optional[int],
                 cluster: Optional[ClusterConfig] = None):
        self.model_cfg, self.python, self.device = model, python, device
        self.mem_fraction = mem_fraction
        self.kv_tokens = kv_tokens  # --max-total-tokens (config.train.sglang_kv_tokens)
        self.dir = Path(out_dir) / "sglang"
        self.cluster = cluster or ClusterConfig()  # the server_* / weight_sync timeouts
        self.rank = dist.get_rank()
        self.ranks, self.ranks_group = tuple(ranks), ranks_group
        self.world = len(self.ranks)
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not one of the servers' ranks {self.ranks}")
        self.local = self.ranks.index(self.rank)
        """This rank's place in the rollout layout."""
        self.shares_device = shares_device and device == "cuda"
        self.layout: Optional[ParallelLayout] = None  # the servers' (tp, dp); None: none running
        self.engine = None          # this rank's server (replica leaders only)
        self.group = None           # weight-update group with that server (leaders only)
        self.version = 0            # pushes so far; the served weights are "it<version>"
        self.fresh = True           # the servers hold no pushed weights yet
        self.last_push: list = []   # HF buckets the server must hold (leaders: re-push on restart)
        self._push_complete = True  # False while a push is under way (last_push is its prefix)
        self.endpoints: list[str] = []
        self.stats: dict = {"restarts": 0, "restart_s": 0.0, "push_s": 0.0, "push_bytes": 0,
                            "push_buckets": 0, "push_bucket_max_bytes": 0}
        self.starts: list[tuple[int, float]] = []  # (tp, seconds) not yet taken by the planner
        self.first_start = "the run's start"
        """Why these servers start at all (a move names itself: trainer/auto.py)."""
        self.start_reasons: list[str] = []
        """Every start of these servers and why: ``<layout>: <reason>`` (the records')."""
        self._released = False

    # ------------------------------------------------------------------ layout
    def ensure(self, layout: ParallelLayout) -> None:
        """Servers in rollout layout ``layout``'s (tp, dp): started, or restarted from another;
        refused with the problem when SGLang cannot run it (the selector offers only such
        layouts). Collective over the servers' ranks."""
        if self.layout is not None and (layout.tp, layout.dp) == (self.layout.tp, self.layout.dp):
            return
        problem = rollout_layout_problem(layout, "sglang")
        if problem:
            raise ValueError(f"SGLang rollout: {problem}")
        lay = ParallelLayout(tp=layout.tp, dp=layout.dp)
        why = self.first_start if self.layout is None else f"layout {self.layout} -> {lay}"
        self.start_reasons.append(f"{lay}: {why}")
        self._start(lay, server_ep(self.model_cfg, layout, self.device))

    def from_leader(self, obj):
        """``obj`` as this rank's replica leader gave it, on every rank of the replica: gathered
        over the servers' ranks when a replica has several (tp > 1). Collective over them. No
        group per replica: one made by its members alone is named from each rank's own count
        of groups (torch's hashed names), which differs between ranks after a move of the
        pools (trainer/auto.py), and its members would wait in different stores forever."""
        if self.layout.tp == 1:
            return obj
        found: list = [None] * self.world
        dist.all_gather_object(found, obj, group=self.ranks_group)
        return found[self.ranks.index(self.leaders()[self.layout.coords(self.local).dp])]

    def leaders(self) -> tuple[int, ...]:
        """The global ranks that push (the first rank of every replica of the servers' layout)."""
        return replica_leaders(self.layout, self.ranks)

    def awake(self):
        """This rank's server, its memory resumed if a rollout released it; None off leaders."""
        if self.engine is not None and self._released:
            self.engine.resume_memory()
            self._released = False
        return self.engine

    def release(self) -> None:
        """After a rollout: a server sharing its GPU with the policy gives its memory back
        (LOGPROB/TRAIN get the GPU); servers that own their devices keep it."""
        if self.engine is not None and self.shares_device:
            self.engine.release_memory()
            self._released = True

    # ------------------------------------------------------------------ weights
    def to_hf(self, bucket: dict) -> list:
        """A bucket of full Megatron tensors as sorted (HF name, host tensor) pairs: kept in host
        memory for a replay after a server restart (on cuda the bucket was assembled on the
        device: it must not stay there). LoRA adapters come under PEFT's names
        (weights/peft_export.py), the modules of a fused linear sharing one A."""
        from earl_megatron.weights.hf_mapping import to_hf
        from earl_megatron.weights.peft_export import peft_bucket

        named = to_hf(self.model_cfg, bucket, partial=True)
        if self.model_cfg.lora.enabled:
            named.update(peft_bucket(self.model_cfg, bucket))
        host: dict[int, torch.Tensor] = {}
        for t in named.values():
            if id(t) not in host:
                host[id(t)] = t.cpu()
        return [(name, host[id(t)]) for name, t in sorted(named.items())]

    def push(self, buckets: Iterable, traffic, t0: float) -> None:
        """(index, count, HF bucket or None) in order, under the next version: the leaders push
        each bucket as it comes (never two copies of the model in a leader's host memory), the
        last one tagged; then the push's metrics (``traffic``: the bytes this rank received to
        assemble them; ``t0``: when the weights started moving). Collective over the ranks.
        LoRA: the base tensors of a push go by the weight-update group untagged, its adapters
        are loaded after the last bucket as adapter ``it<version>`` (``load_adapter``), which
        tags the answers; a push of adapters alone leaves the base and ``last_push`` as they
        were."""
        self.version += 1
        self.awake()
        lora = self.model_cfg.lora.enabled
        adapters: dict = {}
        started = False
        pushed = (0, 0, 0)   # bytes, largest bucket, buckets
        for i, n, hf in buckets:
            pushed = (pushed[0], pushed[1], n)
            if hf is None:
                continue   # not a leader: this rank only sent its shards
            # bytes moved, a fused linear's A counted once
            size = sum(t.numel() * t.element_size() for t in {id(t): t for _, t in hf}.values())
            pushed = (pushed[0] + size, max(pushed[1], size), n)
            adapters.update((k, t) for k, t in hf if k.startswith(PEFT_PREFIX))
            base = [(k, t) for k, t in hf if not k.startswith(PEFT_PREFIX)]
            if base:
                if not started:
                    self.last_push, self._push_complete, started = [], False, True
                last = i == n - 1 and not lora
                self.last_push.append(base)
                self._push_complete = i == n - 1
                self._guarded(lambda: self._push(base, last=last),
                              f"weight push (bucket {i + 1} of {n})")
            del hf
        self._push_complete = True
        if adapters:   # a restart meanwhile loads them again (_repush)
            name = f"it{self.version}"
            self._guarded(lambda: self.engine.load_adapter(
                name, adapters, adapter_config(self.model_cfg, None)), f"adapter load ({name})")
        self.fresh = False
        self._record_push(pushed, traffic, t0)

    def _record_push(self, pushed: tuple, traffic, t0: float) -> None:
        """The push's metrics, the same on every rank of the servers' ranks."""
        leader = self.engine is not None
        total, largest, count = pushed
        g = self.ranks_group
        # [bytes in at a rank that does not push, at a leader, seconds]: the largest over ranks,
        # and the servers restarted after dying, summed over leaders: the same on every rank
        worst = torch.tensor([0.0 if leader else traffic.bytes_received,
                              traffic.bytes_received if leader else 0.0,
                              time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=g)
        self.count_deaths()
        all_bytes = torch.tensor([total, largest], dtype=torch.int64)
        dist.all_reduce(all_bytes, op=dist.ReduceOp.MAX, group=g)  # the leaders' view
        self.stats.update(push_bytes=int(all_bytes[0]), push_buckets=count,
                          push_bucket_max_bytes=int(all_bytes[1]),
                          push_s=time.perf_counter() - t0,
                          bytes_in_max=int(worst[0]), bytes_in_leader=int(worst[1]),
                          sync_s=float(worst[2]))

    def count_deaths(self) -> None:
        """``stats["died"]``: servers restarted after dying, summed over the leaders of the
        servers' layout, so the record after a stage or a push counts a server that died in it;
        the same on every rank of the servers' ranks (a collective over them)."""
        died = torch.tensor([sum(self.engine.restarts) if self.engine is not None else 0])
        dist.all_reduce(died, group=self.ranks_group)
        self.stats["died"] = int(died)

    def take_starts(self) -> list[tuple[int, float]]:
        taken, self.starts = self.starts, []
        return taken

    def pids(self) -> list[int]:
        """The process (group) ids of this rank's server (a leader's; [] elsewhere)."""
        return [p for p in self.engine.server_pids if p is not None] \
            if self.engine is not None else []

    # ------------------------------------------------------------------ servers
    def _start(self, layout: ParallelLayout, ep_size: int = 1) -> None:
        """(Re)start the servers in ``layout`` (each with ``--ep-size ep_size`` when > 1);
        collective over the servers' ranks."""
        from earl_megatron.rollout.sglang_engine import SGLangConfig, SGLangEngine

        t0 = time.perf_counter()
        restart = self.layout is not None
        self.stop()
        me = layout.coords(self.local)
        self.layout = layout
        endpoint = None
        if self.rank == self.leaders()[me.dp]:
            local = int(os.environ.get("LOCAL_RANK", self.rank))
            # replicas whose servers share this node (CPU: its cores; SGLangConfig.host_servers)
            node_ranks = min(int(os.environ.get("LOCAL_WORLD_SIZE", self.world)), self.world)
            c = self.cluster
            lora = self.model_cfg.lora
            cfg = SGLangConfig(python=self.python, model_path=str(self._model_config_dir()),
                               lora_rank=lora.rank if lora.enabled else 0,
                               lora_targets=tuple(target_modules(self.model_cfg))
                               if lora.enabled else (),
                               tp_size=layout.tp, ep_size=ep_size, device=self.device,
                               base_gpu_id=local,
                               host_servers=max(1, layout.dp * node_ranks // self.world),
                               mem_fraction_static=self.mem_fraction,
                               max_total_tokens=self.kv_tokens,
                               enable_memory_saver=self.shares_device,
                               load_format="dummy", startup_timeout_s=c.server_start_timeout_s,
                               request_timeout_s=c.server_request_timeout_s,
                               max_restarts=c.server_max_restarts,
                               log_dir=str(self.dir / f"logs-{layout}-dp{me.dp}"))
            self.engine = SGLangEngine(cfg, on_restart=self._repush)
            self._guarded(self._join_group, "weight-update group setup")
            endpoint = f"{cfg.host}:{self.engine._servers[0].port} tp{layout.tp} (rank {self.rank})"
        found: list = [None] * self.world
        dist.all_gather_object(found, endpoint, group=self.ranks_group)
        self.endpoints = [e for e in found if e is not None]
        self.fresh = True
        if restart:
            self.stats["restarts"] += 1
        # the slowest rank's seconds: every rank records the same value, so every rank's
        # selector prices the next restart alike (plans must agree across ranks)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=self.ranks_group)
        self.stats["restart_s"] = float(took)
        self.starts.append((layout.tp, float(took)))

    def _model_config_dir(self) -> Path:
        """The HF directory the servers start from: config.json only (they start with
        --load-format dummy and receive the trainer's weights before the first request).
        Written by this leader for itself: no barrier, no shared file system needed."""
        from earl_megatron.weights.hf_mapping import to_hf_config

        path = self.dir / f"model-config-rank{self.rank}"
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f"config.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(to_hf_config(self.model_cfg), indent=1))
        os.replace(tmp, path / "config.json")
        return path

    def _guarded(self, action: Callable[[], None], what: str) -> None:
        """Run a leader's action on its server (group setup, a bucket push); if the server
        died or stalled meanwhile, recover it (restart + ``_repush``, which redoes what
        ``action`` was doing) within the engine's restart budget."""
        from earl_megatron.rollout.sglang_engine import RESTORE_FAULTS, SGLangWeightsLost

        try:
            action()
        except SGLangWeightsLost:
            raise
        except RESTORE_FAULTS as e:
            first = (str(e).splitlines() or [""])[0]
            self.engine.recover(0, f"{what}: {type(e).__name__}: {first}")

    def _join_group(self) -> None:
        from earl_megatron.rollout.sglang_weights import (trainer_weight_update_group,
                                                          weight_update_listener)

        backend = "nccl" if self.device == "cuda" else "gloo"
        host = self.engine.config.host
        self._drop_group()
        # the store listens on the servers' address only, on a port the kernel chose for it
        listener = weight_update_listener(host)
        port = listener.getsockname()[1]
        self._group_name = f"earl_weights_{secrets.token_hex(8)}"  # nobody can guess it
        pending = self.engine.start_init_weights_update_group(host, port, self._group_name,
                                                              backend=backend)
        fault_point("sglang.group", pid=self.engine.server_pids[0],
                    log_dir=str(self.engine.log_dir))
        self.group = trainer_weight_update_group(
            host, port, self.engine.weight_update_world_size, self._group_name,
            backend=backend, timeout_s=self.cluster.weight_sync_timeout_s,
            listen_socket=listener)
        pending.result(timeout=self.cluster.server_request_timeout_s)

    def _push(self, hf: list, last: bool) -> None:
        """One bucket of HF tensors into this leader's server; the last one carries the weight
        version, so answers match it only once every bucket is in. NCCL (GPU) broadcasts from
        the device: the bucket is copied there and freed after."""
        if self.device == "cuda":
            hf = [(name, t.to(torch.cuda.current_device())) for name, t in hf]
        self.engine.push_weights_distributed(hf, self.group, group_name=self._group_name,
                                             weight_version=f"it{self.version}" if last else None)

    def _repush(self, index: int) -> None:
        """After a server restart (leader only): a new group, then the weights the server must
        hold, under the same version; a push cut short is replayed untagged (its caller goes
        on with the remaining buckets, the last one tagged). LoRA: the base untagged, then the
        current adapter (the restarted server holds none)."""
        self._join_group()
        lora = self.model_cfg.lora.enabled
        for i, hf in enumerate(self.last_push):
            self._push(hf, last=not lora and self._push_complete
                       and i == len(self.last_push) - 1)
        if lora:
            self.engine.reload_adapter()

    def _drop_group(self) -> None:
        """Destroy the weight-update group (its store and listening socket with it); a group
        whose server died is dropped the same way, whatever its state."""
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - a broken group is being discarded anyway
                pass
            self.group = None

    def stop(self) -> None:
        """Stop this rank's server (if it leads one) and drop its weight-update group."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self._drop_group()
        self.layout = None
