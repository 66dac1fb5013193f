"""The ROLLOUT stage's seam: which engine plays an iteration's episodes, chosen once from
``rollout.engine``.

Every rank calls ``play`` with the policy in the rollout layout. The iteration's episodes are
split into contiguous blocks, one per rollout dp replica, and every rank of replica d returns
block d's sample ids and Episodes (the dispatcher's producer placement: replicas hold whole
episodes). The sample id of the i-th episode of an iteration is i; GRPO groups are runs of
``group_size`` ids sharing an environment seed.

    seeds   s0 s0 s1 s1 | s2 s2 s3 s3      (group_size 2, 8 episodes, rollout DP2)
    replica       0     |       1          every rank of a replica plays its block

Engines: ``embedded`` (EmbeddedRollout: Megatron-Core's own model, KV cache, in the rollout
layout; the default and the CPU path) and ``sglang`` (SGLangRollout, trainer/sglang_rollout.py:
SGLang servers in the rollout layout, their weights from a source the placement picks: the
local policy, pushed by ``sync`` after every TRAIN step, or the train pool's handoff, kept by
``receive`` and pushed by ``push_received``); trainer/rollout_engines.py's ``make_rollout``
picks one (this module imports neither that one nor sglang_rollout: no import loop). Both
implement every method of ``Rollout``, the loops' whole view of an engine, under either
placement: a method that does not apply to an engine's weights is a no-op where nothing needs
doing and an error naming the right call where something would be lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from earl_megatron.envs import make_env
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.specs import PREFILL_TOKENS
from earl_megatron.agents.server import ServerLimits
from earl_megatron.rollout.agent_loop import (AgentLoopConfig, Episode, RolloutAbandoned,
                                              run_episodes)
from earl_megatron.rollout.engine import split_evenly
from earl_megatron.runtime.build import ModelOnLayout
from earl_megatron.trainer.agent_rollout import AgentPlayer, AgentSpec, play_agents
from earl_megatron.trainer.dynamic_pool import world_counts


@dataclass(frozen=True)
class EpisodeSpec:
    """What one episode is: the environment, and the agent loop's bounds."""

    env: str
    env_kwargs: dict
    max_turns: int
    max_context_tokens: int
    max_action_tokens: int
    top_p: float
    routing_replay: bool = False
    """MoE: the engine records each token's experts into Episode.routes (algorithm.routing_replay)."""
    prefill_tokens: int = PREFILL_TOKENS
    """The embedded engine's prefill chunk (rollout.prefill_tokens)."""
    agent: Optional[AgentSpec] = None
    """``env.name=agent``: agent programs play through the endpoint (trainer/agent_rollout.py)
    instead of the agent loop."""
    env_concurrency: int = 1
    """Environments of a turn stepped at once (rollout.env_concurrency)."""

    def limits(self, temperature: float) -> ServerLimits:
        return ServerLimits(max_context_tokens=self.max_context_tokens,
                            max_action_tokens=self.max_action_tokens, max_turns=self.max_turns,
                            temperature=temperature, top_p=self.top_p)


class Rollout(Protocol):
    """What the loops (trainer/colocated.py, trainer/split.py, trainer/handoff.py,
    trainer/evaluation.py) call on an engine."""

    spec: EpisodeSpec

    def play(self, policy: ModelOnLayout, seeds: Sequence[int], *, temperature: float,
             sample_seed: int, opponent: Optional[str] = None, evaluation: bool = False,
             should_stop: Optional[Callable[[], bool]] = None, version: int = 0,
             progress: Optional[Callable[[int, int], None]] = None
             ) -> tuple[list[int], list[Episode]]:
        """This replica's (sample ids, episodes) of the episodes of ``seeds``. ``should_stop``
        is called by every rank of the replica before every turn; True raises
        rollout.agent_loop.RolloutAbandoned (a preempted trainer stops mid-rollout).
        ``evaluation``: an evaluation's play (``opponent`` in place of the environment's own,
        or None), which plays on the engine as it stands. ``version``: the policy's version
        (train steps behind it), recorded on every sampled token (Episode.versions).
        ``progress``: (episodes of the replica ended, the replica's episodes) after every turn
        on the ranks that run the agent loop (a display; agent programs report none)."""

    def play_pool(self, policy, pool, iteration: int, *, sample_seed: int,
                  should_stop: Optional[Callable[[], bool]] = None,
                  version: Optional[int] = None, time_decode: bool = False):
        """Asynchronous RL's stage (trainer/episode_pool.py ``EpisodePool.stage``): this
        replica's block of the batch, its live episodes continued and new ones started, under
        weights of version ``version`` (default ``iteration``); ``time_decode``: the outcome's
        metrics hold ``rollout_decode_s``. ``policy``: the policy, or split placement's
        rollout-pool seat."""

    def sync(self, policy: ModelOnLayout) -> None:
        """After TRAIN: make the engine serve ``policy``'s weights (all ranks call it)."""

    def ensure_servers(self, layout: ParallelLayout) -> None:
        """Split placement, before the handoff: the engine ready to serve ``layout`` (the
        rollout pool's ranks call it)."""

    def receive(self, buckets, traffic) -> None:
        """Split placement's handoff (runtime/weight_transfer.py ``hand_off_full``'s buckets,
        every rank iterating them): keep the weights, to serve after ``push_received``."""

    def push_received(self) -> None:
        """After the meeting: serve the weights the last handoff brought."""

    def metrics(self) -> dict:
        """Engine facts for the iteration's metrics line (the same on every rank)."""

    def take_starts(self) -> list[tuple[int, float]]:
        """(tp, seconds) of every server (re)start since the last call, the same on every rank
        (the planner's profile table keeps them); [] for an engine without servers."""

    def close(self) -> None:
        ...


def weight_sync_metrics(bytes_in_max: int, bytes_in_leader: int, seconds: float) -> dict:
    """The weight sync's keys in every iteration's record (docs/trainer.md): the most bytes of
    weights any rank that does not push received (0 under the weight plan), the most a
    pushing rank (a server's leader) received (at most the model's bytes), and the sync's
    seconds on its slowest rank."""
    return {"weight_sync_bytes_in_max": int(bytes_in_max),
            "weight_sync_bytes_in_leader": int(bytes_in_leader),
            "weight_sync_s": float(seconds)}


def loop_config(spec: EpisodeSpec, temperature: float, sample_seed: int) -> AgentLoopConfig:
    """The agent loop's bounds for one rollout of ``spec``."""
    return AgentLoopConfig(max_turns=spec.max_turns, max_context_tokens=spec.max_context_tokens,
                           max_action_tokens=spec.max_action_tokens, temperature=temperature,
                           top_p=spec.top_p, seed=sample_seed)


def play_episodes(spec: EpisodeSpec, engine, seeds: Sequence[int], tokenizer, *,
                  temperature: float, sample_seed: int, opponent: Optional[str] = None,
                  should_stop: Optional[Callable[[], bool]] = None, version: int = 0,
                  progress: Optional[Callable[[int, int], None]] = None) -> list[Episode]:
    """The agent loop over ``seeds`` on ``engine``, one environment each (``opponent`` in place
    of the environment's own), within the spec's bounds: every rollout's episodes come from
    here, whichever engine decodes them. ``progress``: (episodes ended, episodes) after every
    turn, on this rank (rollout/agent_loop.py ``run_episodes``)."""
    kwargs = dict(spec.env_kwargs)
    if opponent is not None:
        kwargs["opponent"] = opponent
    envs = [make_env(spec.env, **kwargs) for _ in seeds]
    loop = loop_config(spec, temperature, sample_seed)
    return run_episodes(engine, envs, list(seeds), tokenizer, loop, should_stop=should_stop,
                        env_concurrency=spec.env_concurrency, version=version,
                        progress=progress)


class EmbeddedRollout:
    """Episodes decoded by the policy itself (rollout/embedded_engine.py) in its current
    layout; replicas never communicate while decoding (except an MoE layout with ep > 1, whose
    replicas decode in lockstep for the experts' all-to-all: rollout/embedded_engine.py)."""

    def __init__(self, spec: EpisodeSpec, tokenizer):
        self.spec = spec
        self.tok = tokenizer
        self._player: Optional[AgentPlayer] = None
        self._agent_pool = None
        self._eval_player: Optional[AgentPlayer] = None
        self._replica_groups: dict = {}

    def play(self, policy: ModelOnLayout, seeds: Sequence[int], *, temperature: float,
             sample_seed: int, opponent: Optional[str] = None, evaluation: bool = False,
             should_stop: Optional[Callable[[], bool]] = None, version: int = 0,
             progress: Optional[Callable[[int, int], None]] = None
             ) -> tuple[list[int], list[Episode]]:
        from earl_megatron.rollout.embedded_engine import EmbeddedEngine

        sp = self.spec
        block = split_evenly(len(seeds), policy.layout.dp)[policy.coords.dp]
        # routing replay needs every prompt token's experts: prefix reuse would skip them
        engine = EmbeddedEngine(policy, pad_token_id=self.tok.pad_token_id, prompts="replica",
                                reuse_prefix=not sp.routing_replay,
                                record_routes=sp.routing_replay,
                                prefill_tokens=sp.prefill_tokens)
        try:
            if sp.agent is not None and opponent is None:
                return self._play_agents(policy, engine, block, seeds, temperature,
                                         sample_seed, should_stop, version, evaluation)
            episodes = play_episodes(sp, engine, [seeds[i] for i in block], self.tok,
                                     temperature=temperature, sample_seed=sample_seed,
                                     opponent=opponent, should_stop=should_stop,
                                     version=version, progress=progress)
        finally:
            engine.close()
        return list(block), episodes

    def play_pool(self, policy: ModelOnLayout, pool, iteration: int, *, sample_seed: int,
                  should_stop: Optional[Callable[[], bool]] = None,
                  version: Optional[int] = None, time_decode: bool = False):
        """Asynchronous RL's stage (trainer/episode_pool.py): this replica's block of the batch,
        its live episodes continued and new ones started, on the policy as it stands (its
        weights are version ``version``: default ``iteration``). ``time_decode``: the outcome's
        metrics hold ``rollout_decode_s``, the seconds spent decoding (the rest of the stage is
        the environments' and the loop's: what more ranks would not shorten)."""
        from earl_megatron.rollout.embedded_engine import EmbeddedEngine

        sp = self.spec
        engine = EmbeddedEngine(policy, pad_token_id=self.tok.pad_token_id, prompts="replica",
                                reuse_prefix=not sp.routing_replay,
                                record_routes=sp.routing_replay,
                                prefill_tokens=sp.prefill_tokens)
        timed = _TimedEngine(engine)
        agents = {}
        if sp.agent is not None:   # agent programs across stages (trainer/agent_pool.py)
            self._agent_pool = pool
            agents = {"player": self._leader_player(policy, pool.temperature),
                      "group": self._replica_group(policy)}
        try:
            out = pool.stage(policy, timed if time_decode else engine, iteration,
                             sample_seed=sample_seed, should_stop=should_stop, version=version,
                             **agents)
        except RolloutAbandoned:
            if getattr(pool, "dynamic_rounds", None) is not None:
                world_counts(pool, None)   # the replicas that did not stop wait on it
            raise
        finally:
            engine.close()
        if getattr(pool, "dynamic_rounds", None) is not None:
            out.metrics.update(world_counts(pool, out))
        if time_decode:
            out.metrics["rollout_decode_s"] = timed.seconds
        return out

    def _play_agents(self, policy, engine, block, seeds, temperature, sample_seed,
                     should_stop, version, evaluation):
        """The replica's leader serves the endpoint; its other ranks decode its batches. An
        evaluation beside a pool of running agents (asynchronous RL) gets an endpoint of its
        own: its driver must not answer the pool's calls (at its temperature and version)."""
        if evaluation and self._agent_pool is not None:
            c = policy.coords
            if c.tp == 0 and c.pp == 0 and c.cp == 0 and self._eval_player is None:
                self._eval_player = AgentPlayer(self.spec.agent, self.tok,
                                                self.spec.limits(temperature))
            player = self._eval_player
        else:
            player = self._leader_player(policy, temperature)
        return play_agents(player, engine, block, seeds,
                           len(seeds), self.tok, sample_seed=sample_seed,
                           limits=self.spec.limits(temperature),
                           group=self._replica_group(policy), should_stop=should_stop,
                           version=version, evaluation=evaluation)

    def _leader_player(self, policy, temperature: float) -> Optional[AgentPlayer]:
        """The endpoint and agents of this rank when it leads its replica (else None), started
        once and kept, serving at ``temperature``."""
        c = policy.coords
        if not (c.tp == 0 and c.pp == 0 and c.cp == 0):
            return None
        if self._player is None:
            self._player = AgentPlayer(self.spec.agent, self.tok, self.spec.limits(temperature))
        self._player.server.limits = self.spec.limits(temperature)
        return self._player

    def _replica_group(self, policy):
        """A gloo group of this rank's rollout replica (leader first), one per layout; None
        for replicas of one rank."""
        from datetime import timedelta

        import torch.distributed as dist

        from earl_megatron.runtime import groups

        layout = policy.layout
        if layout.tp * layout.pp * layout.cp == 1:
            return None
        if layout not in self._replica_groups:
            # the layout's ranks: the world, or split placement's pool (offset), whose groups
            # its own ranks make alone (the other pool is elsewhere: at the handoff, playing)
            offset, n = groups.pool_span()
            pooled = n != dist.get_world_size()
            mine = None
            for d in range(layout.dp):  # every rank creates every group, in the same order
                ranks = sorted((offset + r for r in range(n) if layout.coords(r).dp == d),
                               key=lambda r: (layout.coords(r - offset).tp,
                                              layout.coords(r - offset).pp,
                                              layout.coords(r - offset).cp, r))
                if pooled and dist.get_rank() not in ranks:
                    continue
                g = dist.new_group(ranks, backend="gloo",
                                   timeout=timedelta(seconds=groups.group_timeout_s()),
                                   use_local_synchronization=pooled)
                if dist.get_rank() in ranks:
                    mine = g
            self._replica_groups[layout] = mine
        return self._replica_groups[layout]

    def sync(self, policy: ModelOnLayout) -> None:
        pass  # the engine decodes with the policy itself: nothing to copy

    def ensure_servers(self, layout: ParallelLayout) -> None:
        pass  # no servers: the engine is built on the policy at every stage

    def receive(self, buckets, traffic) -> None:
        raise RuntimeError("the embedded engine decodes with its pool's own model, which the "
                           "handoff writes into (runtime/weight_transfer.py hand_off): full "
                           "buckets (hand_off_full) are for SGLang servers")

    def push_received(self) -> None:
        pass  # the handoff wrote into the model the engine decodes with: nothing to push

    def metrics(self) -> dict:
        return weight_sync_metrics(0, 0, 0.0)   # nothing moves (``sync``)

    def take_starts(self) -> list[tuple[int, float]]:
        return []

    def close(self) -> None:
        if self._agent_pool is not None:
            self._agent_pool.end()   # its programs stop with the run
        for player in (self._player, self._eval_player):
            if player is not None:
                player.close()
        self._player = self._eval_player = None


class _TimedEngine:
    """An engine whose ``generate`` calls are timed (``seconds``, summed)."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

    def generate(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t
