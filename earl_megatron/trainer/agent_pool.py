"""Asynchronous RL for agent programs (env.name=agent, algorithm.max_staleness = k >= 1): an
agent episode lives across iterations, as trainer/episode_pool.py's episodes of the Env class do.

The rules are plan/staleness.py's, applied to groups as in EpisodePool; what differs is what an
episode is. An agent episode is a running program (agents/programs.py ``start_agent``, on the
replica leader's event loop) talking to that leader's endpoint (agents/server.py); the pool keeps
its future and its AgentEpisode, never its state. Every rank runs ``stage``:

    gather      each replica's leader gives the world its groups: key, seed, finished, oldest
                sampled version (all_gather_object)
    restart     groups whose programs cannot continue here (the rollout layout changed, so their
                endpoint is another rank's; or restored from a checkpoint) are ended and started
                again from their seeds, keys kept (``agent_restarted``)
    drop        groups past the bound: ended, counted (``pool_dropped``), never trained
    admit       new groups up to (k + 1) batches held (``admissible``), placed (``assign_groups``)
    play        the leader decodes the agents' calls (agents/broker.py ReplicaDriver, its other
                ranks in lockstep) until its quota of groups has finished and no live group
                ``must_finish``; every answer is sampled by version ``version``
    pick        the oldest finished groups, quota of them: this replica's block of the batch,
                broadcast from the leader to the replica's ranks

Between stages the programs keep running: a call they make while the weights train waits in the
broker (no stage serves it) and the next stage decodes it with the next version, so each token
records the version that sampled it (``Episode.versions``). The bound: a group trains only when
every token is at most k versions old; the stage waits for a group that could not continue
(``must_finish``), so a drop only happens to a pool restored under a smaller k.

Checkpoints. A running program cannot be serialized: the checkpoint holds the pool's groups as
(key, seed) only, and a resumed run starts them again (their played turns, finished members too,
are discarded, and nothing of them had trained: a group trains whole and leaves the pool when it
does). So every trained episode trained once, keyed by (iteration it started, index); the
exactly-once audit can check keys (``info.pool_key`` of an episode's first row) and that no
trained token is older than k, not that a restarted group replays its first play's tokens. A stop
during the stage rewinds to the pool before it, ending every program (``rewind``).

Sample ids: episode i of the batch (group-aligned as EpisodePool's) has id i for its first row and
i + f * batch for its f-th fork (trainer/agent_rollout.py's numbering).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from earl_megatron.agents.broker import ReplicaDriver
from earl_megatron.plan.dynamic_sampling import extra_group_index, has_signal, refill
from earl_megatron.plan.staleness import (GroupState, admissible, assign_groups, must_finish,
                                          pick_trained, replica_quotas, too_stale)
from earl_megatron.rollout.agent_loop import RolloutAbandoned
from earl_megatron.runtime import groups
from earl_megatron.seeds import ITERATION_STRIDE, episode_seeds, turn_sample_seed
from earl_megatron.trainer.agent_rollout import from_leader, outcome_rows
from earl_megatron.trainer.episode_pool import StageOutcome

SGLANG_REFUSAL = ("env.name=agent with algorithm.max_staleness >= 1 runs its agents on the "
                  "embedded engine (rollout.engine=embedded); with SGLang use "
                  "algorithm.max_staleness=0")


@dataclass
class AgentEntry:
    """One agent episode of the leader's pool: its program's future and, once the gate let it
    open on the server, its AgentEpisode."""

    key: tuple[int, int]
    seed: int
    group_size: int
    future: concurrent.futures.Future
    episode: Any = None

    @property
    def group(self) -> tuple[int, int]:
        return (self.key[0], self.key[1] // self.group_size)

    def oldest(self) -> Optional[int]:
        return None if self.episode is None else self.episode.oldest

    def portable(self) -> dict:
        return {"key": self.key, "seed": self.seed, "group_size": self.group_size,
                "finished": self.future.done(), "oldest": self.oldest()}


def _group_oldest(entries, gkey) -> Optional[int]:
    got = [o for o in (e.oldest() for e in entries if e.group == gkey) if o is not None]
    return min(got) if got else None


class AgentPool:
    """EpisodePool's interface (``begin``, ``stage``, ``rewind``, ``state``, ``state_before``,
    ``restore``) for agent programs; ``end`` stops every program (the run is over)."""

    def __init__(self, env: str, env_kwargs: dict, tokenizer, loop, *, batch: int,
                 group_size: int, max_staleness: int, run_seed: int, env_concurrency: int = 1,
                 dynamic_rounds: Optional[int] = None):
        self.tok, self.batch, self.g, self.k = tokenizer, batch, group_size, max_staleness
        self.dynamic_rounds = dynamic_rounds
        """algorithm.dynamic_sampling_rounds when dynamic sampling is on (None: off): finished
        groups whose rewards are all equal drop, extra rounds start new programs (``_enough``)."""
        self._dyn: Optional[dict] = None
        """This stage's dynamic-sampling state on the leader (rounds, counts, where to start)."""
        self.run_seed, self.temperature = run_seed, loop.temperature
        self.entries: list[AgentEntry] = []
        """The leader's episodes after the last stage ([] on the replica's other ranks)."""
        self.layout, self.replica, self.leader = None, None, False
        self._player = None
        self._gate = None
        self._restored: Optional[list[dict]] = None
        self._restored_layout: Optional[str] = None
        self._pending: Optional[tuple] = None
        self._before: tuple = ([], None)

    # ------------------------------------------------------------------ checkpoints
    def rewind(self) -> None:
        """The last stage will not train: every program ends, and the pool before the stage is
        what the checkpoint holds (its groups restart on resume). Every rank calls it."""
        self.end()
        self._restored, self._restored_layout = self._before
        self.layout, self.replica, self.leader = None, None, False

    def end(self) -> None:
        """End every program of this rank's pool (later calls meet 410) and fail the calls
        waiting for a stage."""
        for e in self.entries:
            e.future.cancel()
        self.entries = []
        if self._player is not None:
            self._player.broker.fail_all(RolloutAbandoned("the agent pool ended its episodes"))

    def state(self) -> dict:
        """The world's groups as (key, seed), the same on every rank (collective unless rewound
        or restored and not yet played)."""
        if self._restored is not None:
            return {"layout": self._restored_layout, "agents": True,
                    "entries": [_to_json(d) for d in self._restored]}
        return {"layout": None if self.layout is None else str(self.layout), "agents": True,
                "entries": [_to_json(d) for d in self._gather()]}

    def state_before(self) -> dict:
        everyone, saved_layout = self._before
        return {"layout": saved_layout, "agents": True,
                "entries": [_to_json(d) for d in everyone]}

    def restore(self, state: dict) -> None:
        """A checkpoint's pool: every group restarts from its seed (module docstring)."""
        if not state.get("agents"):
            raise ValueError("the checkpoint's episode pool is not an agent pool (env.name "
                             "changed since it was saved); resume with the env it was saved with")
        self._restored = [{"key": tuple(d["key"]), "seed": int(d["seed"]),
                           "group_size": int(d["group_size"]), "finished": False,
                           "oldest": None, "replica": None, "restart": True}
                          for d in state["entries"]]
        self._restored_layout = state["layout"]
        self.entries, self.layout, self.replica, self.leader = [], None, None, False

    # ------------------------------------------------------------------ one stage
    def begin(self) -> list[int]:
        """Gathers the world's pool (collective). Returns [] for the planner: an agent's context
        is its program's, not known before its next call."""
        if self._restored is not None:
            self._pending = (self._restored, self._restored_layout)
            self._restored = None
        else:
            self._pending = (self._gather(), None if self.layout is None else str(self.layout))
        return []

    def follow(self, lay) -> None:
        raise ValueError(SGLANG_REFUSAL)

    def stage(self, policy, engine, it: int, *, sample_seed: int,
              should_stop: Optional[Callable[[], bool]] = None, leader: Optional[bool] = None,
              version: Optional[int] = None, player=None, group=None) -> StageOutcome:
        """This replica's block of iteration ``it``'s batch (module docstring). ``player``: the
        replica leader's AgentPlayer (None on its other ranks); ``group``: the replica's gloo
        group, leader first (None for a replica of one rank)."""
        version = it if version is None else version
        if not 0 <= it - version <= self.k:
            raise ValueError(f"iteration {it} sampling with version {version}: the lag must be "
                             f"within algorithm.max_staleness={self.k}")
        lay = policy.layout
        c = policy.coords
        is_leader = c.tp == 0 and c.pp == 0 and c.cp == 0
        if leader is not None or (is_leader and player is None):
            raise ValueError(SGLANG_REFUSAL)
        if self._pending is None:
            self.begin()
        everyone, saved_layout = self._pending
        self._pending, self._before = None, (everyone, saved_layout)
        same = str(lay) == saved_layout

        by_group: dict[tuple, list[dict]] = {}
        for d in everyone:
            by_group.setdefault((d["key"][0], d["key"][1] // d["group_size"]), []).append(d)
        states, restart, ended, dropped, restarted = [], set(), set(), 0, 0
        for gkey, members in sorted(by_group.items()):
            if not same or any(d.get("restart") for d in members):
                restart.add(gkey)
                restarted += len(members)
                states.append(GroupState(gkey, len(members), None, False, None))
                continue
            oldest = [d["oldest"] for d in members if d["oldest"] is not None]
            st = GroupState(gkey, len(members), min(oldest) if oldest else None,
                            all(d["finished"] for d in members), members[0].get("replica"))
            if too_stale(st.oldest, it, self.k):
                dropped += st.size
                ended.add(gkey)
            else:
                states.append(st)
        for e in self.entries:        # programs that cannot continue here end
            if e.group in restart or e.group in ended:
                e.future.cancel()
        held = sum(s.size for s in states)
        new = admissible(self.k, self.batch, self.g, held, lag=it - version)
        quotas = replica_quotas(self.batch // self.g, lay.dp)
        where, placed = assign_groups(states, new, quotas, self.k, same)
        r = c.dp
        quota, offset = quotas[r], sum(quotas[:r])

        entries: list[AgentEntry] = []
        if is_leader:
            self._player = player
            keep = {s.key for s in states if where[s.key] == r and s.key not in restart}
            entries = [e for e in self.entries if e.group in keep]
            for gkey in sorted(g for g in restart if where[g] == r):
                for d in sorted(by_group[gkey], key=lambda d: d["key"]):
                    entries.append(self._start(tuple(d["key"]), d["seed"]))
            seeds = episode_seeds(self.run_seed, it, new * self.g, self.g)
            for j, rep in enumerate(placed):
                if rep == r:
                    entries.extend(self._start((it, j * self.g + m), seeds[j * self.g + m])
                                   for m in range(self.g))
        self.entries, self.layout, self.replica, self.leader = entries, lay, r, is_leader

        if self.dynamic_rounds is not None:
            self._dyn = {"it": it, "replica": r, "replicas": lay.dp, "rounds": 0, "dropped": 0,
                         "played": len({e.group for e in entries}),
                         "target": (self.k - (it - version) + 1) * quota,
                         "span": (self.k + 1) * (self.batch // self.g)}
        driver = ReplicaDriver(engine, group, should_stop=should_stop, version=version)
        got = None
        if is_leader:
            if driver.lead(player.broker, lambda: self._enough(it, quota),
                           lambda b: turn_sample_seed(sample_seed, b)):
                got = self._pick(quota, offset)
        else:
            driver.follow()
        ids, rows, keys = from_leader(got, group)
        counts = None
        if self._dyn is not None and is_leader:
            d = self._dyn
            counts = [d["played"], d["dropped"], len({(k[0], k[1] // self.g) for k in keys}),
                      len({e.group for e in self.entries}), d["rounds"]]
        return StageOutcome(ids, rows, {"pool_carried": held, "pool_admitted": new * self.g,
                                        "pool_dropped": dropped, "agent_restarted": restarted},
                            keys, counts)

    # ------------------------------------------------------------------ helpers
    def _start(self, key: tuple[int, int], seed: int) -> AgentEntry:
        from earl_megatron.agents.programs import agent_gate, start_agent

        p = self._player
        if self._gate is None:
            self._gate = agent_gate(p.spec.concurrency)
        entry = AgentEntry(key, int(seed), self.g, None)
        entry.future = start_agent(p.server, p.task(seed), p.agent, p.reward,
                                   timeout_s=p.spec.timeout_s, gate=self._gate,
                                   opened=lambda ep: setattr(entry, "episode", ep))
        # a finished episode may end the stage: the driver re-checks at once
        entry.future.add_done_callback(lambda _: p.broker.wake())
        return entry

    def _complete(self) -> set:
        out: dict = {}
        for e in self.entries:
            out.setdefault(e.group, []).append(e.future.done())
        return {gk for gk, v in out.items() if all(v)}

    def _reward(self, e: AgentEntry) -> float:
        """A finished program's reward as trained (a lost episode's: 0)."""
        out = e.future.result()
        return 0.0 if out.lost else out.reward

    def _enough(self, it: int, quota: int) -> bool:
        """The quota of groups finished, and no live group that could not continue. Dynamic
        sampling: finished groups without signal drop first, and when nothing is live and too
        few groups have signal, an extra round starts new programs (plan/dynamic_sampling.py
        ``refill``; the stage goes on)."""
        done = self._complete()
        if self._dyn is not None:
            done = self._drop_flat(done)
            if len(done) < quota:
                return not self._refill(quota, len(done))
        if len(done) < quota:
            return False
        return not any(must_finish(_group_oldest(self.entries, gk), it, self.k)
                       for gk in {e.group for e in self.entries} - done)

    def _drop_flat(self, done: set) -> set:
        """Finished groups whose rewards are all equal leave the pool (counted); the rest."""
        rewards: dict = {}
        for e in self.entries:
            if e.group in done:
                rewards.setdefault(e.group, []).append(self._reward(e))
        flat = {gk for gk, r in rewards.items() if not has_signal(r)}
        if flat:
            self.entries = [e for e in self.entries if e.group not in flat]
            self._dyn["dropped"] += len(flat)
        return done - flat

    def _refill(self, quota: int, signal: int) -> bool:
        """Start an extra round's groups when no program is live; whether any started."""
        if any(not e.future.done() for e in self.entries):
            return True     # programs still running: wait for them
        d = self._dyn
        more = refill(quota, signal, len({e.group for e in self.entries}), d["target"],
                      d["rounds"], self.dynamic_rounds)
        if not more:
            return False    # the cap: the block trains with the groups it has
        d["rounds"] += 1
        for j in range(more):
            index = extra_group_index(d["rounds"], d["replica"], d["replicas"], d["span"], j,
                                      ITERATION_STRIDE)
            seed = episode_seeds(self.run_seed, d["it"], (index + 1) * self.g, self.g)[-1]
            self.entries += [self._start((d["it"], index * self.g + m), seed)
                             for m in range(self.g)]
        d["played"] += more
        return True

    def _pick(self, quota: int, offset: int) -> tuple[list, list, list]:
        complete = self._complete()
        if self._dyn is not None:   # a group may have finished since the last _enough
            complete = self._drop_flat(complete)
        done = [GroupState(gk, self.g, _group_oldest(self.entries, gk), True)
                for gk in complete]
        ids, rows, keys = [], [], []
        for pos, gk in enumerate(pick_trained(done, quota)):
            members = sorted((e for e in self.entries if e.group == gk), key=lambda e: e.key)
            for m, e in enumerate(members):
                got = outcome_rows(e.future.result(), e.seed, self.tok)
                got[0].info["pool_key"] = list(e.key)
                for f, row in enumerate(got):
                    ids.append((offset + pos) * self.g + m + f * self.batch)
                    rows.append(row)
                    keys.append(e.key)
        trained = set(keys)
        self.entries = [e for e in self.entries if e.key not in trained]
        return ids, rows, keys

    def _gather(self) -> list[dict]:
        mine = [dict(e.portable(), replica=self.replica) for e in self.entries
                if not e.future.cancelled()] if self.leader else []
        got: list[Any] = [None] * groups.pool_span()[1]
        dist.all_gather_object(got, mine, group=groups.pool_group())
        return [d for part in got for d in part]


def _to_json(d: dict) -> dict:
    return {"key": list(d["key"]), "seed": int(d["seed"]), "group_size": int(d["group_size"])}
