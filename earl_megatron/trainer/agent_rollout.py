"""``env.name=agent``: a replica's episodes played by agent programs through the endpoint.

The replica's leader (tp and pp coordinate 0) serves the OpenAI-compatible endpoint
(agents/server.py, started once and kept across iterations) and runs the agent programs
(agents/programs.py); its driver (agents/broker.py) batches their calls into the engine's
``generate`` on every rank of the replica; at the end the leader broadcasts the rows to the
replica's other ranks, so every rank of a replica holds its samples, as with the built-in loop. Under asynchronous RL
(algorithm.max_staleness >= 1) the episodes outlive a stage instead: trainer/agent_pool.py.

Rows and sample ids. An episode whose agent kept its history is one row; one that edited it
forked into several (agents/trajectory.py). The i-th episode of an iteration of n has sample id
i for its first row and i + k*n for its k-th fork, so ``s % n`` is the episode and
``(s % n) // group_size`` its GRPO group; every row trains with the episode's reward, on its
last sampled turn. A lost episode (its agent raised or ran past ``rollout.agent_timeout_s``)
keeps one row with its loss mask zeroed (it trains nothing and counts in no statistic), so
every episode has a sample and a replica is never empty. Each row's info holds its canonical
``messages`` and ``tools``, and its tokens their versions (``Episode.versions``: the policy
version that sampled each, -1 off the loss mask; () when the driver was given none): the row
decodes to ``ChatRenderer.messages_text(messages, tools, False)`` up to the template's end of
turn.

Task of an episode: ``tasks[seed % len(tasks)]`` (GRPO groups share a seed, so a task); an
evaluation's from ``eval_tasks`` (a verifiers environment's eval dataset, else the tasks).
The tasks and the program come from ``agent_program``: a tasks file and an entry, or a
verifiers environment (``env.kwargs.id``: agents/verifiers_glue.py), which is one more agent
program to everything here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.agents.broker import Broker, ReplicaDriver
from earl_megatron.agents.programs import builtin_agent, load_tasks, resolve, run_agents
from earl_megatron.agents.server import AgentServer, ServerLimits
from earl_megatron.rollout.agent_loop import Episode, RolloutAbandoned
from earl_megatron.runtime import groups

if TYPE_CHECKING:
    from earl_megatron.config.train import TrainConfig
from earl_megatron.seeds import turn_sample_seed

AGENT_ENV = "agent"
METRIC_KEYS = ("agent_calls_per_episode", "agent_tool_calls_per_episode",
               "agent_malformed_tool_calls", "agent_forks", "agent_errors", "agent_timeouts",
               "agent_sampling_overrides", "agent_reward_mean")


@dataclass(frozen=True)
class AgentSpec:
    entry: Optional[str]
    tasks: Optional[str]
    reward: Optional[str]
    concurrency: int
    timeout_s: float
    host: str = "127.0.0.1"
    port: int = 0
    public_url: Optional[str] = None
    max_body_mb: float = 16.0
    max_batch: int = 64
    env_id: Optional[str] = None
    """``env=verifiers``: the verifiers environment module (env.kwargs.id); None: a tasks file."""
    env_args: dict = field(default_factory=dict)
    """Its ``load_environment`` arguments (env.kwargs.args)."""

    @classmethod
    def from_env_kwargs(cls, kwargs: dict, *, concurrency: int, timeout_s: float, host: str,
                        port: int, **server) -> "AgentSpec":
        verifiers = "id" in kwargs or "args" in kwargs   # env=verifiers: its recipe's keys
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if verifiers:
            unknown = set(kwargs) - {"id", "args"}
            if unknown:
                raise ValueError(f"env.kwargs {sorted(unknown)}: env=verifiers reads id and "
                                 "args only (the environment brings its tasks, agent and "
                                 "reward)")
            if not kwargs.get("id"):
                raise ValueError("env=verifiers needs env.kwargs.id=MODULE (an installed "
                                 "verifiers environment: a module with load_environment)")
            if not isinstance(kwargs.get("args", {}), dict):
                raise ValueError(f"env.kwargs.args={kwargs['args']!r}: a mapping of "
                                 "load_environment's arguments, e.g. env.kwargs.args={n: 4}")
            return cls(None, None, None, int(concurrency), float(timeout_s), host, int(port),
                       env_id=str(kwargs["id"]), env_args=dict(kwargs.get("args", {})),
                       **server)
        unknown = set(kwargs) - {"entry", "tasks", "reward"}
        if unknown:
            raise ValueError(f"env.kwargs {sorted(unknown)}: env.name=agent reads entry, tasks "
                             "and reward only")
        if not kwargs.get("tasks"):
            raise ValueError("env.name=agent needs env.kwargs.tasks=PATH (JSONL or parquet, "
                             "one task per row), or env=verifiers env.kwargs.id=MODULE")
        if not kwargs.get("entry") and not kwargs.get("reward"):
            raise ValueError("env.name=agent without env.kwargs.entry plays the built-in "
                             "agent, which needs env.kwargs.reward=package.module:function to "
                             "score its answers")
        return cls(kwargs.get("entry"), str(kwargs["tasks"]), kwargs.get("reward"),
                   int(concurrency), float(timeout_s), host, int(port), **server)


def agent_spec(cfg: TrainConfig) -> Optional[AgentSpec]:
    """env.name=agent: the agent programs' spec; None otherwise. Pure (config only): `earl
    train` calls it before any rank starts, without importing Megatron-Core."""
    if cfg.env.name != "agent":
        return None
    r = cfg.rollout
    return AgentSpec.from_env_kwargs(dict(cfg.env.kwargs), concurrency=r.agent_concurrency,
                                     timeout_s=r.agent_timeout_s, host=r.agent_host,
                                     port=r.agent_port, public_url=r.agent_public_url,
                                     max_body_mb=r.agent_max_body_mb, max_batch=r.agent_max_batch)


def agent_programs_on_moe(cfg: TrainConfig) -> bool:
    """Agent programs on an MoE model decoded by the embedded engine: rollouts at ep = 1
    (replicas with ep > 1 decode in lockstep, which the programs' own timing cannot follow)."""
    return cfg.env.name == "agent" and bool(cfg.model.num_experts) and \
        cfg.rollout.engine == "embedded"


@dataclass(frozen=True)
class AgentProgram:
    """What plays an agent episode: its tasks (an evaluation's too), the agent, the optional
    reward function (agents/programs.py ``run_agents``)."""

    tasks: list
    eval_tasks: list
    agent: Callable
    reward: Optional[Callable]


def agent_program(spec: AgentSpec, max_turns: Optional[int] = None) -> AgentProgram:
    """The spec's program: a verifiers environment's (agents/verifiers_glue.py; ``max_turns``,
    rollout.max_turns, must fit its turns), or the tasks file with the entry (the built-in
    agent without one) and the reward function. AgentConfigError names what is wrong."""
    if spec.env_id is not None:
        from earl_megatron.agents.verifiers_glue import verifiers_program
        p = verifiers_program(spec.env_id, spec.env_args, max_turns)
        return AgentProgram(p.tasks, p.eval_tasks, p.play, None)
    tasks = load_tasks(spec.tasks)
    return AgentProgram(tasks, tasks, resolve(spec.entry, "entry") if spec.entry
                        else builtin_agent, resolve(spec.reward, "reward") if spec.reward
                        else None)


class AgentPlayer:
    """The leader's endpoint and agents, kept across iterations (``close`` stops them)."""

    def __init__(self, spec: AgentSpec, tokenizer, limits: ServerLimits):
        self.spec = spec
        program = agent_program(spec, limits.max_turns)
        self.tasks, self.eval_tasks = program.tasks, program.eval_tasks
        self.agent, self.reward = program.agent, program.reward
        self.broker = Broker(max_batch=spec.max_batch)
        self.server = AgentServer(tokenizer, self.broker, limits, host=spec.host,
                                  port=spec.port, public_url=spec.public_url,
                                  max_body_bytes=int(spec.max_body_mb * 2**20))
        self.server.start()

    def task(self, seed: int, evaluation: bool = False) -> dict:
        """The task an episode of ``seed`` plays (module docstring)."""
        tasks = self.eval_tasks if evaluation else self.tasks
        return tasks[seed % len(tasks)]

    def play(self, driver: ReplicaDriver, seeds: Sequence[int], sample_seed: int,
             limits: ServerLimits, evaluation: bool = False):
        """Outcomes of one episode per seed (sampled within ``limits``: the play's temperature,
        greedy in evaluations; ``evaluation`` plays the evaluation's tasks); None when told to
        stop."""
        import threading

        self.server.limits = limits
        box: dict = {}

        def agents():
            try:
                box["out"] = run_agents(self.server, [self.task(s, evaluation)
                                                      for s in seeds],
                                        self.agent, self.reward,
                                        concurrency=self.spec.concurrency,
                                        timeout_s=self.spec.timeout_s)
            except BaseException as e:  # noqa: BLE001 - re-raised on the trainer's thread
                box["error"] = e
            finally:
                self.broker.poke()

        th = threading.Thread(target=agents, name="agents", daemon=True)
        th.start()
        finished = driver.lead(self.broker, lambda: not th.is_alive(),
                               lambda k: turn_sample_seed(sample_seed, k))
        if not finished:
            # the agents' calls fail from here (503); a program that never calls again is left
            # to its daemon thread: the trainer checkpoints and exits without waiting for it
            self.broker.fail_all(RolloutAbandoned("the trainer is stopping"))
            return None
        th.join()
        if "error" in box:
            raise box["error"]
        return box["out"]

    def close(self) -> None:
        self.server.stop()


def _runs(mask: Sequence[int]) -> int:
    return sum(1 for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1]))


COUNT_KEYS = ("agent_calls", "agent_tool_calls", "agent_malformed", "agent_forks",
              "agent_sampling_overrides")
"""An episode's counts its first row's info carries (``outcome_rows``)."""


def outcome_rows(outcome, seed: int, tokenizer) -> list[Episode]:
    """An outcome's rows as Episodes (module docstring); the first carries the counts."""
    ep = outcome.episode
    if ep is None:   # the agent never reached the endpoint
        rows, counts = [], {**dict.fromkeys(COUNT_KEYS, 0), "task": {}}
        finish = "timeout" if outcome.timed_out and not outcome.error else "error"
    else:
        rows = ep.tokens.rows()
        counts = dict(zip(COUNT_KEYS, (ep.calls, ep.tool_calls, ep.malformed, ep.tokens.forks,
                                       ep.sampling_overrides)), task=ep.task)
        finish = "error" if outcome.error else "timeout" if outcome.timed_out else \
            (ep.finish_reason or "done")
    counts.update(agent_error=outcome.error, agent_timeout=outcome.timed_out, **outcome.info)
    if not rows:
        pad = tokenizer.pad_token_id or 0
        return [Episode(env=AGENT_ENV, seed=seed, token_ids=(pad, pad), loss_mask=(0, 0),
                        logprobs=(0.0, 0.0), reward=0.0, turns=0, finish_reason=finish,
                        prompt_length=2, actions=(), observations=(), info=counts)]
    out = []
    for k, row in enumerate(rows):
        mask = tuple(0 for _ in row.loss_mask) if outcome.lost else tuple(row.loss_mask)
        lps = tuple(0.0 for _ in row.logprobs) if outcome.lost else tuple(row.logprobs)
        versions = tuple(v if m else -1 for v, m in zip(row.versions, mask))
        if any(v < 0 for v, m in zip(versions, mask) if m):
            versions = ()   # sampled by a driver told no version: the iteration's own
        turns = _runs(mask)
        reward = 0.0 if outcome.lost else outcome.reward
        first = next((i for i, m in enumerate(row.loss_mask) if m), len(mask))
        info = counts if k == 0 else {"fork": k, "fork_reason": row.forked_from_reason}
        actions = tuple(m.get("content") or "" for m in row.messages
                        if m.get("role") == "assistant")[-row.turns:]
        out.append(Episode(env=AGENT_ENV, seed=seed, token_ids=tuple(row.token_ids),
                           loss_mask=mask, logprobs=lps, reward=reward, turns=turns,
                           finish_reason=finish, prompt_length=first, actions=actions,
                           observations=(), info={**info, "messages": list(row.messages),
                                                         "tools": list(row.tools)},
                           turn_rewards=(0.0,) * max(turns - 1, 0) + ((reward,) if turns
                                                                      else ()),
                           versions=versions))
    return out


def play_agents(player: Optional[AgentPlayer], engine, block: Sequence[int], seeds: Sequence[int],
                n: int, tokenizer, *, sample_seed: int, limits: ServerLimits, group=None,
                should_stop: Optional[Callable[[], bool]] = None, version: int = -1,
                evaluation: bool = False) -> tuple[list[int], list[Episode]]:
    """This replica's (sample ids, rows) of episodes ``block`` of the iteration's ``n``.
    ``player`` is the leader's (None on the replica's other ranks); every rank of the replica
    calls this with the same ``group`` (its ranks, leader first; None for a replica of one).
    ``evaluation``: the tasks are the evaluation's (``AgentPlayer.task``)."""
    driver = ReplicaDriver(engine, group, should_stop=should_stop, version=version)
    got = None
    if player is not None:
        outcomes = player.play(driver, [seeds[i] for i in block], sample_seed, limits,
                               evaluation)
        if outcomes is not None:
            ids, rows = [], []
            for i, o in zip(block, outcomes):
                for k, row in enumerate(outcome_rows(o, seeds[i], tokenizer)):
                    ids.append(i + k * n)
                    rows.append(row)
            got = (ids, rows)
    else:
        driver.follow()
    return from_leader(got, group)


def from_leader(value, group):
    """The replica leader's ``value`` on every rank of the replica (``group``: None when the
    leader decodes alone); RolloutAbandoned when it is None (a stop while agents played)."""
    box = [value]
    if group is not None:
        dist.broadcast_object_list(box, group=group, group_src=0)
    if box[0] is None:
        raise RolloutAbandoned("stopped while agents played")
    return box[0]


def agent_metrics(owner: bool, ids: Sequence[int], episodes: Sequence[Episode], n: int) -> dict:
    """Per-iteration agent metrics over the world (every rank calls; the owner of each replica
    counts its episodes once)."""
    acc = torch.zeros(9, dtype=torch.float64)
    for s, e in zip(ids, episodes):
        if not owner or s >= n:
            continue
        i = e.info
        lost = bool(i.get("agent_error")) or bool(i.get("agent_timeout"))
        acc += torch.tensor([1, i.get("agent_calls", 0), i.get("agent_tool_calls", 0),
                             i.get("agent_malformed", 0), i.get("agent_forks", 0),
                             bool(i.get("agent_error")), bool(i.get("agent_timeout")),
                             i.get("agent_sampling_overrides", 0),
                             0.0 if lost else e.reward], dtype=torch.float64)
    dist.all_reduce(acc, group=groups.pool_group())
    eps = max(acc[0].item(), 1.0)
    kept = max(acc[0].item() - acc[5].item() - acc[6].item(), 1.0)
    return dict(zip(METRIC_KEYS, (acc[1].item() / eps, acc[2].item() / eps, int(acc[3]),
                                  int(acc[4]), int(acc[5]), int(acc[6]), int(acc[7]),
                                  acc[8].item() / kept)))
