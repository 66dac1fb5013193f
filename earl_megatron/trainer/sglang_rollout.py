"""The ROLLOUT stage on SGLang servers: one server per rollout dp replica, weights pushed from
Megatron after every TRAIN step, servers restarted when the rollout layout changes.

    rollout layout tp2 x dp2, 4 trainer ranks (pp = cp = 1: the selector offers nothing else
    for this engine):

    ranks      0  1 | 2  3            replica d = ranks d*tp .. d*tp + tp-1 (one node)
    replica       0 |    1
    leader     0    | 2               the replica's first rank owns its server
    server     :p0 tp2 (GPUs 0,1) | :p1 tp2 (GPUs 2,3)     ports published to every rank
    episodes   leader plays its block over HTTP, broadcasts it in the replica's group

Invariants:
- Every rank of replica d returns block d of the iteration's episodes (trainer/rollout.py's
  producer placement), so LOGPROB/TRAIN receive them point to point as with the embedded engine.
- No answer is used from weights other than the trainer's current ones: each push carries a
  weight version (``it<k>``), every /generate answer carries the server's version, and the
  engine raises on a mismatch. Pushes happen after every TRAIN step (``sync``) and before the
  first request of fresh servers (start, layout change).
- Weights reach the servers by a weight plan (plan/weight_plan.py, run by
  runtime/weight_transfer.py): each replica leader receives, point to point, the rows of the
  train layout's shards it lacks, in buckets of at most ``rollout.sglang_bucket_mb``, converts
  each bucket to HF names and pushes it; no other rank receives any weight. Only the last
  bucket carries the new version, so no answer matches it before every bucket is in.
- Servers start from the model's config.json alone (``--load-format dummy``): nothing of the
  model's size is built or written before they start; the trainer's weights arrive by the
  distributed update before the first request.
- A server that dies or stalls is restarted by SGLangEngine's supervision wherever it fails: in
  a rollout request, during a weight push, while the weight-update group forms, or while it
  starts. ``on_restart`` rejoins a new group and re-pushes what the server must hold (the
  leader keeps the current push's HF buckets in host memory; a push cut short is replayed up to
  where it stopped and then continues), and the failed turn's requests are resubmitted: no
  episode is lost, none sampled from other weights. The budget of all this is the cluster's
  server_* and weight_sync_timeout_s keys, checked against collective_timeout_s (config).
- The weight-update group's store listens on the servers' address only (loopback), on a port
  the kernel picked for it, under a random name.
- Servers are stopped by their process group on close(), at exit, and when a layout changes.

GPU (``rollout.sglang_device=cuda``): servers are colocated with training on the replica's GPUs
with ``--enable-memory-saver``; memory is resumed before a push or a rollout and released after
the rollout, before LOGPROB/TRAIN. Not run in this project's CI (no GPU there).
CPU (``sglang_device=cpu``): servers are separate processes with the kit's flags; weights travel
over gloo.
Split placement (trainer/split.py, ``ranks=`` the rollout pool, ``ranks_group=`` its
group): the servers run on the rollout pool's ranks only, every collective above on the pool's
group; the pool holds no Megatron model, so weights never come by ``sync`` but by the train
pool's handoff: ``receive`` keeps the buckets the weight plan assembled at each leader (HF
names, host memory), ``push_received`` pushes them after the meeting under the next version.
The servers own their devices there (no memory saver, no release between stages).
MoE (Qwen3-MoE): the same push (per-expert HF names, gathered over the ep ranks of the train
layout); each server splits its experts with ``--ep-size server_ep(...)`` (docs/sglang.md).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.config.train import ConfigError, sglang_mem_fraction
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.rollout_rules import rollout_layout_problem
from earl_megatron.rollout.agent_loop import Episode
from earl_megatron.rollout.engine import split_evenly
from earl_megatron.runtime.build import ModelOnLayout
from earl_megatron.runtime.fault_points import fault_point
from earl_megatron.trainer.agent_rollout import AgentPlayer, play_agents
from earl_megatron.trainer.rollout import EpisodeSpec, play_episodes, weight_sync_metrics



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


class SGLangRollout:
    """``Rollout`` over SGLang servers in the rollout layout (see the module docstring)."""

    def __init__(self, spec: EpisodeSpec, tokenizer, model: ModelConfig, *, python: str,
                 device: str, out_dir: Path, cluster: Optional[ClusterConfig] = None,
                 mem_fraction: Optional[float] = None, kv_tokens: Optional[int] = None,
                 bucket_bytes: int = 512 << 20, ranks: Optional[Sequence[int]] = None,
                 ranks_group=None):
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"rollout.sglang_device={device!r}: use cpu or cuda")
        self.mem_fraction = sglang_mem_fraction(mem_fraction, device)
        self.kv_tokens = kv_tokens  # --max-total-tokens (config.train.sglang_kv_tokens)
        self.spec, self.tok, self.model_cfg = spec, tokenizer, model
        self.python, self.device = python, device
        self.dir = Path(out_dir) / "sglang"
        self.cluster = cluster or ClusterConfig()  # the server_* / weight_sync timeouts
        self.bucket_bytes = bucket_bytes
        self.rank = dist.get_rank()
        self.pooled = ranks is not None
        """Split placement: the servers run on a rollout pool, ``ranks`` (global ranks, in the
        layout's order), whose collectives go on ``ranks_group``; their weights come from the
        train pool's handoff (``receive``), never from ``sync``. Else every rank of the world
        is a rollout rank, colocated with training."""
        self.ranks = tuple(ranks) if self.pooled else tuple(range(dist.get_world_size()))
        self.world = len(self.ranks)
        self.ranks_group = ranks_group if self.pooled else None
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not one of the servers' ranks {self.ranks}")
        self.local = self.ranks.index(self.rank)
        """This rank's place in the rollout layout."""
        # colocated on a GPU: the servers give their memory back while the trainer trains; a
        # rollout pool's GPUs are the servers' own
        self.shares_device = device == "cuda" and not self.pooled
        self.layout: Optional[ParallelLayout] = None  # the servers' (tp, dp); None: none running
        self.engine = None          # this rank's server (replica leaders only)
        self.group = None           # weight-update group with that server (leaders only)
        self.replica_group = None   # ranks of this rank's replica (episodes are broadcast here)
        self._player = None         # env.name=agent: the leader's endpoint (agent_rollout.py)
        self.version = 0            # pushes so far; the served weights are "it<version>"
        self.last_push: list = []   # HF buckets the server must hold (leaders: re-push on restart)
        self._push_complete = True  # False while a push is under way (last_push is its prefix)
        self.endpoints: list[str] = []
        self.stats: dict = {"restarts": 0, "restart_s": 0.0, "push_s": 0.0, "push_bytes": 0,
                            "push_buckets": 0, "push_bucket_max_bytes": 0}
        self.starts: list[tuple[int, float]] = []  # (tp, seconds) not yet taken by the planner
        self._fresh = True          # servers hold no pushed weights yet
        self._incoming: list = []   # pooled: the last handoff's HF buckets (leaders), to push
        self._incoming_count = 0
        self._received_traffic = None
        self._pushed = (0, 0, 0)    # the last push: bytes, largest bucket, buckets
        self._released = False

    # ------------------------------------------------------------------ Rollout
    def play(self, policy: ModelOnLayout, seeds: Sequence[int], *, temperature: float,
             sample_seed: int, opponent: Optional[str] = None, evaluation: bool = False,
             should_stop: Optional[Callable[[], bool]] = None, version: int = 0
             ) -> tuple[list[int], list[Episode]]:
        # ``should_stop`` is a collective over the replica, but here only the replica's first
        # rank runs the agent loop (the others wait in the broadcast): a stop request is
        # honoured at the next stage boundary instead of the next turn
        del should_stop
        self._serve(policy, evaluation)
        me = self.layout.coords(self.local)
        block = list(split_evenly(len(seeds), self.layout.dp)[me.dp])
        episodes: list = [None]
        if self.engine is not None:
            if self._released:
                self.engine.resume_memory()
                self._released = False
            if self.spec.agent is not None and opponent is None:
                # agent programs through the endpoint; the servers batch their calls
                if self._player is None:
                    self._player = AgentPlayer(self.spec.agent, self.tok,
                                               self.spec.limits(temperature))
                episodes[0] = play_agents(self._player, self.engine, block, seeds, len(seeds),
                                          self.tok, sample_seed=sample_seed,
                                          limits=self.spec.limits(temperature))
            else:
                episodes[0] = (block, play_episodes(
                    self.spec, self.engine, [seeds[i] for i in block], self.tok,
                    temperature=temperature, sample_seed=sample_seed, opponent=opponent,
                    version=version))
            if self.shares_device:
                self.engine.release_memory()  # LOGPROB/TRAIN get the GPU back
                self._released = True
        if self.replica_group is not None:
            dist.broadcast_object_list(episodes, group=self.replica_group, group_src=0)
        ids, played = episodes[0]
        return list(ids), played

    def play_pool(self, policy, pool, iteration: int, *, sample_seed: int,
                  should_stop: Optional[Callable[[], bool]] = None,
                  version: Optional[int] = None, time_decode: bool = False):
        """Asynchronous RL's stage (trainer/episode_pool.py): each replica's leader continues
        and starts its episodes through its server and broadcasts the outcome to the replica;
        the pool lives on the leaders. A stop request is honoured at the stage's end (as in
        ``play``). ``policy``: the policy (colocated), or the rollout pool's ``PoolSeat``
        (split placement: the servers hold the weights, version ``version``);
        ``time_decode``: as ``EmbeddedRollout.play_pool`` (the seconds in the servers'
        requests)."""
        from earl_megatron.trainer.rollout import _TimedEngine

        del should_stop
        self._serve(policy, evaluation=False)
        out: list = [None]
        if self.engine is not None:
            if self._released:
                self.engine.resume_memory()
                self._released = False
            timed = _TimedEngine(self.engine)
            out[0] = pool.stage(policy, timed if time_decode else self.engine, iteration,
                                sample_seed=sample_seed, leader=True, version=version)
            if time_decode:
                out[0].metrics["rollout_decode_s"] = timed.seconds
            if self.shares_device:
                self.engine.release_memory()
                self._released = True
        else:
            pool.follow(policy.layout)
        if self.pooled:   # the record after this stage counts a server that died in it
            self.stats["died"] = self._deaths()
        if self.replica_group is not None:
            dist.broadcast_object_list(out, group=self.replica_group, group_src=0)
        return out[0]

    def _serve(self, policy, evaluation: bool) -> None:
        """Servers in the policy's rollout layout, holding its weights. Training rollouts put
        the servers in the planned layout; evaluations play on the servers as they stand, so
        they never restart them. A rollout pool's servers (split placement) hold what the last
        handoff brought (``receive``), which comes before any stage."""
        lay = policy.layout
        if self.pooled:
            if self.layout is None or self._fresh:
                raise RuntimeError("SGLang servers of the rollout pool hold no weights yet: "
                                   "the train pool's handoff (receive) comes first")
            if (lay.tp, lay.dp) != (self.layout.tp, self.layout.dp):
                raise RuntimeError(f"the rollout pool plays in {lay} on servers in "
                                   f"{self.layout}: start them in it (ensure_servers) first")
            return
        if self.layout is None or (not evaluation and (lay.tp, lay.dp) !=
                                   (self.layout.tp, self.layout.dp)):
            self._start_in(lay)
        if self._fresh:
            self.sync(policy)

    def sync(self, policy: ModelOnLayout) -> None:
        """Push the policy's weights (any layout) into every server: the weight plan
        (runtime/weight_transfer.py) assembles each bucket of full tensors (at most
        ``bucket_bytes``) at the replica leaders only, which convert it to HF names and push it;
        the other ranks send their shards and receive nothing. All ranks call it (colocated;
        a rollout pool's servers get their weights by ``receive``)."""
        from earl_megatron.runtime.transport import Traffic
        from earl_megatron.runtime.weight_transfer import full_weights_at

        if self.pooled:
            raise RuntimeError("a rollout pool's servers get their weights by the handoff "
                               "(receive, push_received), not sync")
        if self.layout is None:
            return  # no servers yet: the first play pushes before its first request
        t0 = time.perf_counter()
        traffic = Traffic()
        # ranks numbered node by node (torchrun): a leader's rows come from its node first
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        # never two copies of the model in the leader's host memory: each bucket is pushed as
        # it lands; a restart meanwhile replays the buckets pushed so far, untagged (``_repush``)
        self._push_all((i, n, None if bucket is None else self._to_hf(bucket))
                       for i, n, bucket in full_weights_at(policy, self.leaders(),
                                                           self.bucket_bytes, traffic,
                                                           devices_per_node=per_node))
        self._record_push(traffic, t0)

    def receive(self, buckets, traffic) -> None:
        """Split placement's handoff, on the rollout pool (every rank of the world iterates the
        plan, runtime/weight_transfer.py ``hand_off_full``): each leader converts the buckets
        of full weights it receives to HF names and keeps them in host memory; nothing reaches
        the servers yet, so the handoff's time bound never counts a server (its restarts belong
        to ``push_received``, after the meeting)."""
        self._incoming, self._received_traffic = [], traffic
        for i, n, bucket in buckets:
            if bucket is not None:
                self._incoming.append(self._to_hf(bucket))
            self._incoming_count = n

    def push_received(self) -> None:
        """The buckets the last handoff brought, into this rank's server (its leader), under the
        next version; collective over the rollout pool. A server that dies or stalls meanwhile
        is restarted and the push replayed, within the restart budget."""
        if not self.pooled or self.layout is None:
            raise RuntimeError("push_received: servers of a rollout pool that received a "
                               "handoff (ensure_servers, receive) first")
        t0 = time.perf_counter()
        incoming, n = self._incoming, self._incoming_count
        self._incoming = []
        self._push_all((i, n, incoming[i] if self.engine is not None else None)
                       for i in range(n))
        self._record_push(self._received_traffic, t0)

    def ensure_servers(self, layout: ParallelLayout) -> None:
        """A rollout pool's servers in ``layout`` (started, or restarted in another (tp, dp));
        collective over the pool."""
        if not self.pooled:
            raise RuntimeError("ensure_servers is for a rollout pool's servers")
        if self.layout is None or (layout.tp, layout.dp) != (self.layout.tp, self.layout.dp):
            self._start_in(layout)

    def _start_in(self, layout: ParallelLayout) -> None:
        """(Re)start the servers in rollout layout ``layout``'s (tp, dp), refused with the
        problem when SGLang cannot run it (the selector offers only such layouts)."""
        problem = rollout_layout_problem(layout, "sglang")
        if problem:
            raise ValueError(f"SGLang rollout: {problem}")
        self._start(ParallelLayout(tp=layout.tp, dp=layout.dp),
                    server_ep(self.model_cfg, layout, self.device))

    def _to_hf(self, bucket: dict) -> list:
        """A bucket of full Megatron tensors as sorted (HF name, host tensor) pairs: kept in host
        memory for a replay after a server restart (on cuda the bucket was assembled on the
        device: it must not stay there)."""
        from earl_megatron.weights.hf_mapping import to_hf

        return [(name, t.cpu()) for name, t in
                sorted(to_hf(self.model_cfg, bucket, partial=True).items())]

    def _push_all(self, buckets) -> None:
        """(index, count, HF bucket or None) in order: the leaders push each bucket, the last
        one tagged with the next version; ``last_push`` holds what was pushed."""
        self.version += 1
        if self.engine is not None and self._released:
            self.engine.resume_memory()
            self._released = False
        self.last_push, self._push_complete = [], False
        self._pushed = (0, 0, 0)   # bytes, largest bucket, buckets
        for i, n, hf in buckets:
            self._pushed = (self._pushed[0], self._pushed[1], n)
            if hf is None:
                continue   # not a leader: this rank only sent its shards
            size = sum(t.numel() * t.element_size() for _, t in hf)
            self._pushed = (self._pushed[0] + size, max(self._pushed[1], size), n)
            self.last_push.append(hf)
            self._push_complete = i == n - 1
            self._guarded(lambda: self._push(hf, last=i == n - 1),
                          f"weight push (bucket {i + 1} of {n})")
            del hf
        self._push_complete = True
        self._fresh = False

    def _record_push(self, traffic, t0: float) -> None:
        """The push's metrics, the same on every rank of the servers' ranks."""
        leader = self.engine is not None
        total, largest, count = self._pushed
        g = self.ranks_group
        # [bytes in at a rank that does not push, at a leader, seconds]: the largest over ranks,
        # and the servers restarted after dying, summed over leaders: the same on every rank
        worst = torch.tensor([0.0 if leader else traffic.bytes_received,
                              traffic.bytes_received if leader else 0.0,
                              time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=g)
        died = self._deaths()
        all_bytes = torch.tensor([total, largest], dtype=torch.int64)
        dist.all_reduce(all_bytes, op=dist.ReduceOp.MAX, group=g)  # the leaders' view
        self.stats.update(push_bytes=int(all_bytes[0]), push_buckets=count,
                          push_bucket_max_bytes=int(all_bytes[1]),
                          push_s=time.perf_counter() - t0, died=died,
                          bytes_in_max=int(worst[0]), bytes_in_leader=int(worst[1]),
                          sync_s=float(worst[2]))

    def _deaths(self) -> int:
        """Servers restarted after dying, summed over the leaders of the servers' layout: the
        same on every rank of the servers' ranks (a collective over them)."""
        died = torch.tensor([sum(self.engine.restarts) if self.engine is not None else 0])
        dist.all_reduce(died, group=self.ranks_group)
        return int(died)

    def leaders(self) -> tuple[int, ...]:
        """The global ranks that push (the first rank of every replica of the servers' layout)."""
        return replica_leaders(self.layout, self.ranks)

    def metrics(self) -> dict:
        """What the iteration's metrics line records about the servers (same on every rank)."""
        return {"rollout_servers": list(self.endpoints),
                "rollout_weight_version": f"it{self.version}",
                "rollout_push_s": self.stats["push_s"],
                "rollout_push_bytes": self.stats["push_bytes"],
                "rollout_push_buckets": self.stats["push_buckets"],
                "rollout_push_bucket_max_bytes": self.stats["push_bucket_max_bytes"],
                "rollout_layout_restarts": self.stats["restarts"],
                "rollout_server_restart_s": self.stats["restart_s"],
                "rollout_servers_died": self.stats.get("died", 0),
                **weight_sync_metrics(self.stats.get("bytes_in_max", 0),
                                      self.stats.get("bytes_in_leader", 0),
                                      self.stats.get("sync_s", 0.0))}

    def take_starts(self) -> list[tuple[int, float]]:
        taken, self.starts = self.starts, []
        return taken

    def close(self) -> None:
        if self._player is not None:
            self._player.close()
            self._player = None
        self._stop()

    # ------------------------------------------------------------------ servers
    def _start(self, layout: ParallelLayout, ep_size: int = 1) -> None:
        """(Re)start the servers in ``layout`` (each with ``--ep-size ep_size`` when > 1);
        collective over the servers' ranks (the world, or the rollout pool)."""
        from earl_megatron.rollout.sglang_engine import SGLangConfig, SGLangEngine

        t0 = time.perf_counter()
        restart = self.layout is not None
        self._stop()
        replicas = [[self.ranks[i] for i in range(self.world) if layout.coords(i).dp == d]
                    for d in range(layout.dp)]
        self.replica_group = None
        if len(replicas[0]) > 1:
            # the replica's other ranks wait here for the leader's whole rollout, restarts
            # included: the world's timeout, which the config orders after those
            timeout = timedelta(seconds=self.cluster.collective_timeout_s)
            for ranks in replicas:
                if self.pooled and self.rank not in ranks:
                    continue   # a pool's replica groups are made by their members only
                # colocated, every rank creates every group, in the same order
                g = dist.new_group(ranks, backend="gloo", timeout=timeout,
                                   use_local_synchronization=self.pooled)
                if self.rank in ranks:
                    self.replica_group = g
        self.layout = layout
        me = layout.coords(self.local)
        endpoint = None
        if self.rank == replicas[me.dp][0]:
            local = int(os.environ.get("LOCAL_RANK", self.rank))
            # replicas whose servers share this node (CPU: its cores; SGLangConfig.host_servers)
            node_ranks = min(int(os.environ.get("LOCAL_WORLD_SIZE", self.world)), self.world)
            c = self.cluster
            cfg = SGLangConfig(python=self.python, model_path=str(self._model_config_dir()),
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
        self._fresh = True
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
        on with the remaining buckets, the last one tagged)."""
        self._join_group()
        for i, hf in enumerate(self.last_push):
            self._push(hf, last=self._push_complete and i == len(self.last_push) - 1)

    def _drop_group(self) -> None:
        """Destroy the weight-update group (its store and listening socket with it); a group
        whose server died is dropped the same way, whatever its state."""
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - a broken group is being discarded anyway
                pass
            self.group = None

    def _stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self._drop_group()
        self.layout = None
