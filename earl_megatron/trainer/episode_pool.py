"""Asynchronous RL's rollout stage: episodes in flight across iterations (algorithm.max_staleness
>= 1; the embedded engine or SGLang servers).

The rules are plan/staleness.py's; this module moves the episodes. Every rank runs ``stage``:

    gather      each replica's leader gives the world its pool (all_gather_object)
    drop        groups that would break the bound (counted in ``pool_dropped``)
    admit       new groups up to (k + 1) batches held, seeds from seeds.episode_seeds
    place       groups to the rollout layout's replicas (sticky while the layout stays)
    play        this replica's live episodes, batched, until its quota of groups has finished
                and no live group is at the bound (agent_loop.play_turns; an episode that
                moved is rebuilt by replay_env)
    pick        the oldest finished groups, quota of them, become this replica's block of the
                batch (sample ids group-aligned: group j of the batch holds ids j*g .. j*g+g-1)
    keep        the rest (unfinished, finished and waiting) stay in this replica's pool

Dynamic sampling (algorithm.dynamic_sampling; plan/dynamic_sampling.py, trainer/dynamic_pool.py):
``play`` counts only finished groups whose rewards vary; a finished group whose rewards are all
equal is dropped from the pool (counted, never trained), and a round that ends with no episode
live and too few groups refills the freed slots (new groups, new sampling seed) and plays again,
at most algorithm.dynamic_sampling_rounds times; the block then trains with what it has. k = 0
with dynamic sampling runs through this pool too (one batch admitted, played to the end).

Every rank of a replica plays the same episodes in lockstep (the embedded engine decodes on all
of them), so every rank of a replica holds the same pool; only the leader's copy travels. With
SGLang the replica's leader alone plays, through its server, and holds the pool; the other
ranks ``follow`` (the same gather) and get the outcome from it.
Episodes continue under the new weights at their next turn: their context is re-prefilled in
whatever layout the selector picked, and each token keeps the version that sampled it
(``Episode.versions``).

A stop during the stage (or after it, before TRAIN) rewinds the pool to what it was before the
stage (``rewind``): the checkpoint of the last completed iteration holds that pool, and the
resumed run replays the stage exactly, as the synchronous loop replays an abandoned iteration.
``state()``/``restore()`` put the pool into a checkpoint and back (the episodes' environments
rebuilt by replay, their MoE routes kept exactly), so a resumed run continues the same episodes
and none is trained twice or half.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

from earl_megatron.envs import make_env
from earl_megatron.plan.dynamic_sampling import extra_group_index, has_signal, refill
from earl_megatron.plan.staleness import (GroupState, admissible, assign_groups, must_finish,
                                          pick_trained, replica_quotas, too_stale)
from earl_megatron.rollout import routing_replay
from earl_megatron.rollout.agent_loop import (AgentLoopConfig, Episode, LiveEpisode,
                                              play_turns, replay_env, start_episode)
from earl_megatron.runtime import groups
from earl_megatron.seeds import ITERATION_STRIDE, episode_seeds, round_sample_seed
from earl_megatron.trainer.dynamic_pool import drop_flat, group_rewards


@dataclass
class Entry:
    """One episode of the pool: live (``live``) or finished and waiting to train (``episode``)."""

    key: tuple[int, int]
    """(the iteration it started in, its index among that iteration's episodes)."""
    seed: int
    group_size: int
    live: Optional[LiveEpisode] = None
    episode: Optional[Episode] = None

    @property
    def group(self) -> tuple[int, int]:
        return (self.key[0], self.key[1] // self.group_size)

    def oldest(self) -> Optional[int]:
        return _oldest_version(self.episode.versions if self.episode is not None
                               else self.live.versions)

    def portable(self) -> dict:
        """What travels between ranks and into a checkpoint (no environment object)."""
        return {"key": self.key, "seed": self.seed, "group_size": self.group_size,
                "live": None if self.live is None else self.live.data(),
                "episode": self.episode}


@dataclass
class StageOutcome:
    ids: list[int]
    episodes: list[Episode]
    metrics: dict = field(default_factory=dict)
    keys: list[tuple[int, int]] = field(default_factory=list)
    """The pool key (iteration started, index) of each episode, beside ``ids``."""
    dynamic: Optional[list] = None
    """Dynamic sampling: this replica's counts (plan/dynamic_sampling.py ``DynamicCounts``
    ``as_list``), summed over the world by trainer/dynamic_pool.py ``world_counts``."""


class EpisodePool:
    def __init__(self, env: str, env_kwargs: dict, tokenizer, loop: AgentLoopConfig, *,
                 batch: int, group_size: int, max_staleness: int, run_seed: int,
                 env_concurrency: int, dynamic_rounds: Optional[int] = None):
        self.env, self.env_kwargs, self.tok, self.loop = env, dict(env_kwargs), tokenizer, loop
        self.batch, self.g, self.k = batch, group_size, max_staleness
        # self.k, the bound: auto placement sets it to 0 while its plan is colocated (trainer/auto.py)
        self.run_seed, self.env_concurrency = run_seed, env_concurrency
        self.dynamic_rounds = dynamic_rounds
        """algorithm.dynamic_sampling_rounds when dynamic sampling is on (finished groups with
        equal rewards drop, extra rounds refill: plan/dynamic_sampling.py); None: off."""
        self.entries: list[Entry] = []
        """This replica's pool after the last stage (the same on every rank of the replica)."""
        self.layout = None
        self.replica: Optional[int] = None
        self.leader = False
        self._restored: Optional[list[dict]] = None
        self._restored_layout: Optional[str] = None
        self._pending: Optional[tuple] = None
        """``begin``'s gathered pool (and the layout it was saved in, after a restore)."""
        self._before: tuple = ([], None)
        """The pool before the last stage and the layout it was in (``rewind``)."""

    # ------------------------------------------------------------------ checkpoints
    def rewind(self) -> None:
        """The last stage will not train (told to stop during or after it): the pool goes back
        to what it was before the stage, so the resumed run replays the stage exactly (the
        synchronous loop's rule for an abandoned iteration). Every rank calls it."""
        self._restored, self._restored_layout = self._before
        self.entries, self.layout, self.replica, self.leader = [], None, None, False

    def state(self) -> dict:
        """The whole pool (every replica's) as JSON, the same on every rank: for the
        checkpoint's loop state. Collective over the world (unless rewound or restored and
        not yet played: then every rank holds it whole)."""
        if self._restored is not None:
            return {"layout": self._restored_layout,
                    "entries": [_to_json(d) for d in self._restored]}
        return {"layout": None if self.layout is None else str(self.layout),
                "entries": [_to_json(d) for d in self._gather()]}

    def state_before(self) -> dict:
        """The whole pool as it was before the last stage, as ``state`` writes it; every rank
        holds it (no collective). Split placement checkpoints this beside weights that have
        moved on: the resumed run plays that stage again, under the newer weights."""
        everyone, saved_layout = self._before
        return {"layout": saved_layout, "entries": [_to_json(d) for d in everyone]}

    def restore(self, state: dict) -> None:
        """The pool a checkpoint saved (``state``); its episodes stay on their replicas when
        the rollout layout is the one they were saved in, else are dealt out anew."""
        self._restored = [_from_json(d) for d in state["entries"]]
        self._restored_layout = state["layout"]
        self.entries, self.layout, self.replica, self.leader = [], None, None, False

    # ------------------------------------------------------------------ one stage
    def begin(self) -> list[int]:
        """Gathers the world's pool for the next ``stage`` (collective) and returns the contexts
        (tokens) of its live episodes, which the selector plans the rollout stage with."""
        if self._restored is not None:
            self._pending = (self._restored, self._restored_layout)
            self._restored = None
        else:
            self._pending = (self._gather(), None if self.layout is None else str(self.layout))
        return sorted(len(d["live"]["tokens"]) for d in self._pending[0]
                      if d["live"] is not None)

    def follow(self, lay) -> None:
        """The stage of a rank that holds none of its replica's episodes (SGLang: the replica's
        leader plays through its server and hands it the outcome), gathering the pool as the
        leader's ``stage`` does (the same collective, or the pool just restored)."""
        if self._pending is None:
            self.begin()
        everyone, saved_layout = self._pending
        self._pending, self._before = None, (everyone, saved_layout)
        self.entries, self.layout, self.leader = [], lay, False
        self.replica = lay.coords(groups.pool_rank()).dp

    def stage(self, policy, engine, it: int, *, sample_seed: int,
              should_stop: Optional[Callable[[], bool]] = None,
              leader: Optional[bool] = None, version: Optional[int] = None) -> StageOutcome:
        """This replica's block of iteration ``it``'s batch (module docstring). ``engine``
        decodes for this replica with the policy's weights, version ``version`` (default
        ``it``; split placement's rollout pool samples with the version it holds, one or more
        steps behind: admission then allows k - lag + 1 batches). ``leader``: this rank's copy
        of the pool is the one that travels (default: tp, pp, cp coordinate 0; every rank of
        the replica plays)."""
        version = it if version is None else version
        if not 0 <= it - version <= self.k:
            raise ValueError(f"iteration {it} sampling with version {version}: the lag must be "
                             f"within algorithm.max_staleness={self.k}")
        lay = policy.layout
        if self._pending is None:
            self.begin()
        everyone, saved_layout = self._pending
        self._pending, self._before = None, (everyone, saved_layout)
        same = str(lay) == saved_layout   # the groups' replica numbers mean the same replicas
        mine_before = {e.key: e for e in self.entries}

        groups: dict[tuple, list[dict]] = {}
        for d in everyone:
            groups.setdefault((d["key"][0], d["key"][1] // d["group_size"]), []).append(d)
        states, dropped = [], 0
        for gkey, members in sorted(groups.items()):
            oldest = [o for o in (_oldest(d) for d in members) if o is not None]
            st = GroupState(gkey, len(members), min(oldest) if oldest else None,
                            all(d["episode"] is not None for d in members),
                            members[0].get("replica"))
            if too_stale(st.oldest, it, self.k):
                dropped += st.size
            else:
                states.append(st)
        held = sum(s.size for s in states)
        new = admissible(self.k, self.batch, self.g, held, lag=it - version)
        quotas = replica_quotas(self.batch // self.g, lay.dp)
        where, placed = assign_groups(states, new, quotas, self.k, same)
        r = policy.coords.dp
        kept_keys = {s.key for s in states if where[s.key] == r}

        # this replica's episodes: carried ones (local objects when they stayed), then new ones
        entries: list[Entry] = []
        for gkey in sorted(kept_keys):
            for d in sorted(groups[gkey], key=lambda d: d["key"]):
                local = mine_before.get(d["key"]) if same else None
                entries.append(local if local is not None else self._rebuild(d))
        for j, rep in enumerate(placed):
            if rep == r:
                entries += self._start_group(it, j)
        quota = quotas[r]
        dyn = self.dynamic_rounds is not None

        def complete(extra: list, signal: bool = dyn) -> list[GroupState]:
            """The replica's finished groups (``signal``: those whose rewards vary)."""
            ends = group_rewards(entries, extra)
            return [GroupState(gk, len(v), None, True) for gk, v in ends.items()
                    if None not in v and (not signal or has_signal(v))]

        def enough(extra: list) -> bool:
            """The replica's quota of groups finished (dynamic sampling: with signal), and no
            live group left that could not continue into the next stage."""
            if len(complete(extra)) < quota:
                return False
            finished = {gs.key for gs in complete(extra, signal=False)}
            return not any(must_finish(_group_oldest(entries, gk), it, self.k)
                           for gk in {e.group for e in entries} - finished)

        rnd, dropped_groups, played = 0, 0, len({e.group for e in entries})
        while True:   # one round; dynamic sampling: more while groups without signal drop
            lives = [e.live for e in entries if e.live is not None]
            loop = AgentLoopConfig(**{**self.loop.__dict__,
                                      "seed": round_sample_seed(sample_seed, rnd)})
            finished, _ = play_turns(engine, lives, self.tok, loop, version=version,
                                     should_stop=should_stop, enough=enough,
                                     env_concurrency=self.env_concurrency)
            self._keep(lay, r, entries, finished, leader)
            if not dyn:
                break
            entries, gone = drop_flat(entries)
            dropped_groups += gone
            self.entries = entries
            live = any(e.live is not None for e in entries)
            held_groups = len({e.group for e in entries})
            more = 0 if live else refill(quota, len(complete([])), held_groups,
                                         (self.k - (it - version) + 1) * quota, rnd,
                                         self.dynamic_rounds)
            if not more:
                break
            rnd += 1
            span = (self.k + 1) * (self.batch // self.g)
            for j in range(more):
                entries += self._start_group(it, extra_group_index(
                    rnd, r, lay.dp, span, j, ITERATION_STRIDE))
            played += more

        done = [GroupState(gk, self.g, _group_oldest(self.entries, gk), True)
                for gk in {s.key for s in complete([])}]
        chosen = pick_trained(done, quota)
        offset = sum(quotas[:r])
        ids, episodes, keys = [], [], []
        for pos, gk in enumerate(chosen):
            members = sorted((e for e in self.entries if e.group == gk), key=lambda e: e.key)
            for m, e in enumerate(members):
                ids.append((offset + pos) * self.g + m)
                episodes.append(e.episode)
                keys.append(e.key)
        trained = set(keys)
        self.entries = [e for e in self.entries if e.key not in trained]
        counts = None
        if dyn:
            carried = len({e.group for e in self.entries})
            counts = [played, dropped_groups, len(chosen), carried, rnd]
        return StageOutcome(ids, episodes, {"pool_carried": held, "pool_admitted": new * self.g,
                                            "pool_dropped": dropped}, keys, counts)

    def _start_group(self, it: int, j: int) -> list[Entry]:
        """The episodes of group ``j`` of iteration ``it``, started (keys (it, j*g + m))."""
        out = []
        seed = episode_seeds(self.run_seed, it, (j + 1) * self.g, self.g)[-1]
        for m in range(self.g):
            i = j * self.g + m
            started = start_episode(make_env(self.env, **self.env_kwargs), seed,
                                    self.tok, self.loop, key=(it, i))
            e = Entry((it, i), seed, self.g)
            if isinstance(started, Episode):
                e.episode = started
            else:
                e.live = started
            out.append(e)
        return out

    # ------------------------------------------------------------------ helpers
    def _keep(self, lay, r: int, entries: list[Entry], finished: list,
              leader: Optional[bool]) -> None:
        got = dict(finished)
        for e in entries:
            if e.key in got:
                e.episode, e.live = got[e.key], None
        self.entries, self.layout, self.replica = entries, lay, r
        self.leader = _coords(lay) if leader is None else leader

    def _gather(self) -> list[dict]:
        mine = [dict(e.portable(), replica=self.replica) for e in self.entries] \
            if self.leader else []
        got: list[Any] = [None] * groups.pool_span()[1]
        dist.all_gather_object(got, mine, group=groups.pool_group())
        return [d for part in got for d in part]

    def _rebuild(self, d: dict) -> Entry:
        e = Entry(tuple(d["key"]), d["seed"], d["group_size"], episode=d["episode"])
        if d["live"] is not None:
            env = replay_env(make_env(self.env, **self.env_kwargs), d["seed"],
                             d["live"]["actions"])
            e.live = LiveEpisode(env=env, **{**d["live"], "key": e.key})
        return e


def _to_json(d: dict) -> dict:
    """A portable entry as JSON; MoE routes (live or finished) travel exactly, so an episode
    in flight replays its experts after a resume (rollout/routing_replay.py)."""
    ep, live = d["episode"], d["live"]
    if ep is not None:
        ep = {f.name: getattr(ep, f.name) for f in dataclasses.fields(ep)}
        ep["routes"] = routing_replay.to_json(ep["routes"])
    if live is not None:
        live = {**live, "key": list(d["key"]),
                "routes": routing_replay.to_json(live.get("routes"))}
    return {**d, "key": list(d["key"]), "episode": ep, "live": live}


def _from_json(d: dict) -> dict:
    ep, live = d["episode"], d["live"]
    if ep is not None:
        ep = Episode(**{k: tuple(v) if isinstance(v, list) else v for k, v in ep.items()
                        if k != "routes"}, routes=routing_replay.from_json(ep.get("routes")))
    if live is not None:
        live = {**live, "routes": routing_replay.from_json(live.get("routes"))}
    return {**d, "key": tuple(d["key"]), "episode": ep, "live": live}


def _coords(lay) -> bool:
    """Is this rank its rollout replica's leader (tp, pp, cp coordinate 0)?"""
    c = lay.coords(groups.pool_rank())
    return c.tp == 0 and c.pp == 0 and c.cp == 0


def _oldest(d: dict) -> Optional[int]:
    return _oldest_version(d["episode"].versions if d["episode"] is not None
                           else d["live"]["versions"])


def _oldest_version(versions) -> Optional[int]:
    """The oldest version among sampled tokens (-1 marks the others); None: none sampled."""
    sampled = [v for v in versions if v >= 0]
    return min(sampled) if sampled else None


def _group_oldest(entries: list[Entry], gkey) -> Optional[int]:
    got = [o for o in (e.oldest() for e in entries if e.group == gkey) if o is not None]
    return min(got) if got else None


def staleness_metrics(owner: bool, episodes: list[Episode], iteration: int,
                      max_staleness: int) -> dict:
    """``staleness_mean``, ``staleness_max`` and ``staleness_shares`` ({age: fraction}) over the
    trained tokens of the world's batch (every rank calls; one rank per replica counts)."""
    import torch

    from earl_megatron.plan.staleness import staleness, token_ages

    counts = torch.zeros(max_staleness + 1, dtype=torch.float64)
    if owner:
        for e in episodes:
            for age, n in token_ages(e.versions, e.loss_mask, iteration).items():
                if not 0 <= age <= max_staleness:
                    raise RuntimeError(f"a trained token is {age} versions old in iteration "
                                       f"{iteration}, past algorithm.max_staleness="
                                       f"{max_staleness}: the episode pool broke its bound")
                counts[age] += n
    dist.all_reduce(counts, group=groups.pool_group())
    st = staleness({a: int(n) for a, n in enumerate(counts.tolist())}, int(counts.sum()))
    return {"staleness_mean": st.mean, "staleness_max": st.max,
            "staleness_shares": {str(a): f for a, f in st.shares.items()}}
