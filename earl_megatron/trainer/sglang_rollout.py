"""The ROLLOUT stage on SGLang servers (trainer/sglang_servers.py: one server per rollout dp
replica on the engine's ranks), and the two sources the servers' weights come from.

    placement   ranks, group            weights from              after TRAIN / at the meeting
    colocated   the world, default      LocalWeights: the policy  sync(trainee): pushed
                                        on these ranks            (the weight plan, at leaders)
    split       the rollout pool, its   HandoffWeights: the train receive(buckets): kept at the
                pool group              pool's handoff            leaders; push_received(): pushed

    rollout layout tp2 x dp2 on 4 ranks: replica d's leader plays block d of the iteration's
    episodes over HTTP on its server and hands it to the replica's other ranks.

The placement picks the source (trainer/rollout_engines.py ``make_rollout(weights=...)``); every
method of ``SGLangRollout`` is the same for both, and a source refuses, with the fix, what does
not apply to it (``sync`` of a handoff's servers, ``receive`` of the policy's own).

Invariants:
- Every rank of replica d returns block d of the iteration's episodes (trainer/rollout.py's
  producer placement), so LOGPROB/TRAIN receive them point to point as with the embedded engine.
- No answer is used from weights other than the ones the source last pushed (versions: see
  trainer/sglang_servers.py). A local source pushes after every TRAIN step (``sync``) and
  before the first request of fresh servers (start, layout change); a handoff source pushes
  what each handoff brought after the meeting (``push_received``), and a stage before any
  handoff, or in a layout the servers are not in, is refused.
- Weights reach the servers by a weight plan (plan/weight_plan.py, run by
  runtime/weight_transfer.py): each replica leader receives the rows of the source's shards it
  lacks, in buckets (local: ``rollout.sglang_bucket_mb``; handoff: the handoff's), converts each
  to HF names and pushes it; no other rank receives any weight.
- Training stages put the servers in the planned layout (a local source restarts them there);
  evaluations play on the servers as they stand.
- A stop request is honoured at the stage's end: only the replica's leader runs the agent loop
  (the others wait for its outcome), and ``should_stop`` is a collective over the replica.

GPU (``rollout.sglang_device=cuda``): with a local source the servers share the policy's GPUs
(``--enable-memory-saver``; memory resumed before a push or a rollout, released after the
rollout, before LOGPROB/TRAIN); a handoff source's servers own the rollout pool's GPUs. Not run
in this project's CI (no GPU there). CPU (``sglang_device=cpu``): servers are separate
processes with the kit's flags; weights travel over gloo.
MoE (Qwen3-MoE): the same push (per-expert HF names, gathered over the ep ranks of the source's
layout); each server splits its experts with ``--ep-size server_ep(...)`` (docs/sglang.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.config.model import ModelConfig
from earl_megatron.config.train import ConfigError, sglang_mem_fraction
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.rollout.agent_loop import Episode
from earl_megatron.rollout.engine import split_evenly
from earl_megatron.runtime.build import ModelOnLayout
from earl_megatron.trainer.agent_rollout import AgentPlayer, play_agents
from earl_megatron.trainer.dynamic_pool import world_counts
from earl_megatron.trainer.rollout import (EpisodeSpec, _TimedEngine, play_episodes,
                                           weight_sync_metrics)
from earl_megatron.trainer.sglang_servers import SGLangServers


NOT_A_HANDOFF = ("SGLang servers colocated with the policy take its weights by sync after "
                 "TRAIN, not by a handoff (receive, push_received): a rollout pool's servers "
                 "are made with make_rollout('sglang', ranks=..., weights='handoff')")


class LocalWeights:
    """Weights from the policy on the servers' own ranks (colocated placement): its shards are
    pushed after every TRAIN step (``sync``) and into fresh servers before their first request;
    on a GPU the servers share the policy's devices."""

    shares_device = True

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        """The weight plan's largest bucket (``rollout.sglang_bucket_mb``)."""

    def prepare(self, servers: SGLangServers, policy: ModelOnLayout, evaluation: bool) -> None:
        """Servers in the policy's layout (an evaluation plays on them as they stand), holding
        its weights."""
        if servers.layout is None or not evaluation:
            servers.ensure(policy.layout)
        if servers.fresh:
            self.sync(servers, policy)

    def sync(self, servers: SGLangServers, policy: ModelOnLayout) -> None:
        """The policy's weights (any layout) into every server: the weight plan assembles each
        bucket of full tensors at the replica leaders only, which convert it to HF names and
        push it as it lands; the other ranks send their shards and receive nothing."""
        from earl_megatron.runtime.transport import Traffic
        from earl_megatron.runtime.weight_transfer import full_weights_at

        if servers.layout is None:
            return  # no servers yet: the first play pushes before its first request
        t0 = time.perf_counter()
        traffic = Traffic()
        # ranks numbered node by node (torchrun): a leader's rows come from its node first
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", servers.world))
        # LoRA: servers that hold the frozen base get the adapters alone
        lora_only = policy.cfg.lora.enabled and not servers.fresh
        servers.push(((i, n, None if bucket is None else servers.to_hf(bucket))
                      for i, n, bucket in full_weights_at(policy, servers.leaders(),
                                                          self.bucket_bytes, traffic,
                                                          devices_per_node=per_node,
                                                          adapters_only=lora_only)),
                     traffic, t0)

    def receive(self, servers, buckets, traffic) -> None:
        raise RuntimeError(NOT_A_HANDOFF)

    def push_received(self, servers) -> None:
        raise RuntimeError(NOT_A_HANDOFF)


class HandoffWeights:
    """Weights from the train pool's handoff (split placement): the servers' ranks hold no
    model; ``receive`` keeps the full buckets each leader was handed (HF names, host memory),
    ``push_received`` pushes them after the meeting, outside the handoff's time bound. The
    servers own their devices (no memory saver)."""

    shares_device = False

    def __init__(self):
        self._incoming: list = []   # the last handoff's HF buckets (leaders), to push
        self._count = 0             # buckets in that handoff (every rank)
        self._traffic = None

    def prepare(self, servers: SGLangServers, policy, evaluation: bool) -> None:
        """The servers must hold a handoff's weights, in the layout the stage plays in (both
        come at the handoff, before any stage)."""
        lay = policy.layout
        if servers.layout is None or servers.fresh:
            raise RuntimeError("SGLang servers of the rollout pool hold no weights yet: "
                               "the train pool's handoff (receive) comes first")
        if (lay.tp, lay.dp) != (servers.layout.tp, servers.layout.dp):
            raise RuntimeError(f"the rollout pool plays in {lay} on servers in "
                               f"{servers.layout}: start them in it (ensure_servers) first")

    def sync(self, servers, policy) -> None:
        raise RuntimeError("a rollout pool's servers get their weights by the handoff "
                           "(receive, push_received), not sync")

    def receive(self, servers: SGLangServers, buckets, traffic) -> None:
        self._incoming, self._traffic = [], traffic
        for i, n, bucket in buckets:
            if bucket is not None:
                self._incoming.append(servers.to_hf(bucket))
            self._count = n

    def push_received(self, servers: SGLangServers) -> None:
        if servers.layout is None:
            raise RuntimeError("push_received: servers of a rollout pool that received a "
                               "handoff (ensure_servers, receive) first")
        t0 = time.perf_counter()
        incoming, n = self._incoming, self._count
        self._incoming = []
        servers.push(((i, n, incoming[i] if servers.engine is not None else None)
                      for i in range(n)), self._traffic, t0)


class SGLangRollout:
    """``Rollout`` over SGLang servers on ``ranks`` (global ranks in the rollout layout's order,
    their collectives on ``ranks_group``; None: the world's), fed by ``source`` (module
    docstring)."""

    def __init__(self, spec: EpisodeSpec, tokenizer, model: ModelConfig, *, python: str,
                 device: str, out_dir: Path, ranks: Sequence[int], ranks_group,
                 source, cluster: Optional[ClusterConfig] = None,
                 mem_fraction: Optional[float] = None, kv_tokens: Optional[int] = None):
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"rollout.sglang_device={device!r}: use cpu or cuda")
        self.spec, self.tok, self.source = spec, tokenizer, source
        self.servers = SGLangServers(model, python=python, device=device, out_dir=out_dir,
                                     ranks=ranks, ranks_group=ranks_group,
                                     shares_device=source.shares_device,
                                     mem_fraction=sglang_mem_fraction(mem_fraction, device),
                                     kv_tokens=kv_tokens, cluster=cluster)
        self._player = None         # env.name=agent: the leader's endpoint (agent_rollout.py)

    @property
    def engine(self):
        """This rank's server (replica leaders only; None elsewhere)."""
        return self.servers.engine

    @property
    def last_push(self) -> list:
        """The HF buckets this leader last pushed (what its server holds)."""
        return self.servers.last_push

    @property
    def endpoints(self) -> list[str]:
        return self.servers.endpoints

    # ------------------------------------------------------------------ Rollout
    def play(self, policy: ModelOnLayout, seeds: Sequence[int], *, temperature: float,
             sample_seed: int, opponent: Optional[str] = None, evaluation: bool = False,
             should_stop: Optional[Callable[[], bool]] = None, version: int = 0,
             progress: Optional[Callable[[int, int], None]] = None
             ) -> tuple[list[int], list[Episode]]:
        del should_stop   # honoured at the stage's end (module docstring)
        s = self.servers
        self.source.prepare(s, policy, evaluation)
        block = list(split_evenly(len(seeds), s.layout.dp)[s.layout.coords(s.local).dp])
        out: list = [None]
        engine = s.awake()
        if engine is not None:
            if self.spec.agent is not None and opponent is None:
                # agent programs through the endpoint; the servers batch their calls
                if self._player is None:
                    self._player = AgentPlayer(self.spec.agent, self.tok,
                                               self.spec.limits(temperature))
                out[0] = play_agents(self._player, engine, block, seeds, len(seeds), self.tok,
                                     sample_seed=sample_seed,
                                     limits=self.spec.limits(temperature),
                                     evaluation=evaluation)
            else:
                out[0] = (block, play_episodes(
                    self.spec, engine, [seeds[i] for i in block], self.tok,
                    temperature=temperature, sample_seed=sample_seed, opponent=opponent,
                    version=version, progress=progress))
            s.release()
        self._after_stage(out)
        ids, played = out[0]
        return list(ids), played

    def play_pool(self, policy, pool, iteration: int, *, sample_seed: int,
                  should_stop: Optional[Callable[[], bool]] = None,
                  version: Optional[int] = None, time_decode: bool = False):
        """Asynchronous RL's stage (trainer/episode_pool.py): each replica's leader continues
        and starts its episodes through its server and hands the outcome to the replica;
        the pool lives on the leaders. ``policy``: the policy (local source), or the rollout
        pool's ``PoolSeat`` (handoff source: the servers hold the weights, version
        ``version``); ``time_decode``: as ``EmbeddedRollout.play_pool`` (the seconds in the
        servers' requests)."""
        del should_stop   # honoured at the stage's end (module docstring)
        s = self.servers
        self.source.prepare(s, policy, evaluation=False)
        out: list = [None]
        engine = s.awake()
        if engine is not None:
            timed = _TimedEngine(engine)
            out[0] = pool.stage(policy, timed if time_decode else engine, iteration,
                                sample_seed=sample_seed, leader=True, version=version)
            if time_decode:
                out[0].metrics["rollout_decode_s"] = timed.seconds
            s.release()
        else:
            pool.follow(policy.layout)
        self._after_stage(out)
        if getattr(pool, "dynamic_rounds", None) is not None:   # every rank holds the outcome now
            out[0].metrics.update(world_counts(pool, out[0]))
        return out[0]

    def _after_stage(self, out: list) -> None:
        """The stage's deaths counted (the record after it counts a server that died in it),
        then the leader's outcome on every rank of its replica."""
        self.servers.count_deaths()
        out[0] = self.servers.from_leader(out[0])

    def sync(self, policy: ModelOnLayout) -> None:
        """After TRAIN: the policy's weights into the servers (a local source; every rank of
        the servers calls it). A handoff source refuses: its weights come by ``receive``."""
        self.source.sync(self.servers, policy)

    def ensure_servers(self, layout: ParallelLayout) -> None:
        """Servers in ``layout`` (started, or restarted in another (tp, dp)); collective over
        the servers' ranks. A handoff's servers are started here before its ``receive``."""
        self.servers.ensure(layout)

    def start_servers(self, policy: ModelOnLayout) -> None:
        """Servers in ``policy``'s layout holding its weights, before the first stage (a local
        source: a move into colocated placement starts them from the checkpoint's policy);
        collective over the servers' ranks."""
        self.source.prepare(self.servers, policy, evaluation=False)

    def started_by(self, reason: str) -> None:
        """Why these servers start (a move, trainer/auto.py): their first start's reason in
        the records' ``rollout_server_starts``."""
        self.servers.first_start = reason

    def server_pids(self) -> list[int]:
        """This rank's server processes (a replica leader's; [] elsewhere)."""
        return self.servers.pids()

    def receive(self, buckets, traffic) -> None:
        """The handoff (runtime/weight_transfer.py ``hand_off_full``, iterated by every rank
        of the world): each leader keeps the full buckets it receives, as HF names in host
        memory; nothing reaches the servers yet, so the handoff's time bound never counts a
        server (its restarts belong to ``push_received``, after the meeting)."""
        self.source.receive(self.servers, buckets, traffic)

    def push_received(self) -> None:
        """The last handoff's buckets into the servers under the next version; collective over
        the servers' ranks. A server that dies or stalls meanwhile is restarted and the push
        replayed, within the restart budget."""
        self.source.push_received(self.servers)

    def metrics(self) -> dict:
        """What the iteration's metrics line records about the servers (same on every rank)."""
        s = self.servers
        return {"rollout_servers": list(s.endpoints),
                "rollout_weight_version": f"it{s.version}",
                "rollout_push_s": s.stats["push_s"],
                "rollout_push_bytes": s.stats["push_bytes"],
                "rollout_push_buckets": s.stats["push_buckets"],
                "rollout_push_bucket_max_bytes": s.stats["push_bucket_max_bytes"],
                "rollout_layout_restarts": s.stats["restarts"],
                "rollout_server_starts": list(s.start_reasons),
                "rollout_server_restart_s": s.stats["restart_s"],
                "rollout_servers_died": s.stats.get("died", 0),
                **weight_sync_metrics(s.stats.get("bytes_in_max", 0),
                                      s.stats.get("bytes_in_leader", 0),
                                      s.stats.get("sync_s", 0.0))}

    def take_starts(self) -> list[tuple[int, float]]:
        return self.servers.take_starts()

    def close(self) -> None:
        if self._player is not None:
            self._player.close()
            self._player = None
        self.servers.stop()
