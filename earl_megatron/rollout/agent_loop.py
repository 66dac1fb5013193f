"""The multi-turn agent loop: many episodes batched against one RolloutEngine.

Each turn, every live episode's whole context (token ids so far) goes to the engine in ONE
``generate`` call; each episode's sampled tokens go to its environment as text, and the
environment's answer is rendered with the chat template, in the role it names
(``StepResult.role``: "user", or "tool" for a tool's result), and appended. An episode is one
token sequence trained under a loss mask:

    [prompt: system + obs0 + gen prompt][sampled turn 1][end/obs1/gen prompt][sampled turn 2]...
     loss_mask 0                         1               0                    1
     logprobs  0.0                       engine's        0.0                  engine's

Token-in/token-out (tests check it with SmolLM2's own tokenizer, tests/real/test_real_chat.py):
the assistant's ids are exactly the sampled ids, never decoded and re-encoded; everything between
them is the template's own tokens (rollout/tokenizer.py); and the decoded episode is the chat
template's text of the whole conversation (assistant contents = decoded sampled tokens) up to
the closing of its last turn. A turn cut by ``max_action_tokens`` is closed by the template's
end-of-turn token (loss mask 0, logprob 0.0: the model never sampled it, so nothing trains it)
before the next observation, as slime and verl close truncated turns; the last turn of an
episode is not closed (no token would ever be trained after it): the template's text of the
whole conversation is the decoded episode + (end-of-turn if that turn was cut) +
``ChatFormat.turn_suffix``.

Invariants (tests check them against a real model):
- ``len(token_ids) == len(loss_mask) == len(logprobs)``; loss_mask is 1 exactly on tokens the
  engine sampled (the end-of-turn token included when sampled), and logprobs are the engine's
  there and 0.0 elsewhere.
- ``len(token_ids) <= max_context_tokens``. A turn is only started when the context plus a full
  ``max_action_tokens`` turn fits; otherwise the episode ends with finish_reason "max_context".
  After ``max_turns`` sampled turns it ends with "max_turns". Neither is silent: finish_reason
  says which, and the reward is what the environment paid so far (0 for an unfinished game).
- An episode that ended by the environment (win/loss/draw, answer, bad action) has finish_reason
  "done"; its last observation is kept in ``observations`` but not appended to the tokens (no
  policy token follows it, so training would never read it).
- Sampling is reproducible: turn t uses seed ``turn_sample_seed(config.seed, t)`` (earl_megatron/
  seeds.py) for the whole batch.
- Every sampled token records the policy version that sampled it (``Episode.versions``, -1 off
  the loss mask). ``play_turns`` may stop at a turn boundary with episodes still live
  (``enough``); they continue in a later call, perhaps under newer weights and another layout
  (their context is prefilled again), and equal an uninterrupted episode at the same weights
  (tests/distributed/test_async_rl.py). A ``LiveEpisode`` travels as data (``data``) and its
  environment is rebuilt by ``replay_env``.
- The environments of a turn step concurrently (``env_concurrency`` threads); results are
  taken in episode order, so nothing depends on which tool answers first.
- ``should_stop`` (optional) is called once before every turn, on every rank that runs the loop,
  the same number of times (all ranks of a replica play the same episodes in lockstep, so it may
  be a collective over the replica); when it returns True the loop raises ``RolloutAbandoned``
  and returns no episode: a preempted trainer never trains on half-played episodes.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from earl_megatron.envs.base import Env
from earl_megatron.rollout import routing_replay
from earl_megatron.rollout.engine import RolloutEngine, SamplingParams
from earl_megatron.rollout.tokenizer import chat_format, render_next_turn, render_prompt
from earl_megatron.seeds import turn_sample_seed


class RolloutAbandoned(Exception):
    """The caller's ``should_stop`` asked the agent loop to stop before the next turn.
    ``finished``: the (key, Episode) pairs that had ended by then (``play_turns``)."""

    def __init__(self, message: str, finished: Optional[list] = None):
        super().__init__(message)
        self.finished = list(finished or [])


@dataclass(frozen=True)
class AgentLoopConfig:
    max_turns: int = 16
    """Sampled assistant turns per episode at most."""
    max_context_tokens: int = 1024
    """Tokens per episode at most (prompt, sampled and environment tokens together)."""
    max_action_tokens: int = 8
    """Tokens sampled per turn at most (the engine's max_new_tokens)."""
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_turns < 1 or self.max_action_tokens < 1:
            raise ValueError(f"max_turns and max_action_tokens must be >= 1, got "
                             f"{self.max_turns}, {self.max_action_tokens}")
        if self.max_context_tokens <= self.max_action_tokens:
            raise ValueError(f"max_context_tokens={self.max_context_tokens} leaves no room for a "
                             f"prompt before a {self.max_action_tokens}-token turn; raise it")


@dataclass(frozen=True)
class Episode:
    env: str
    seed: int
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Rollout logprob of each token under the engine; 0.0 where loss_mask is 0."""
    reward: float
    """Total reward of the episode (the sum of ``turn_rewards``)."""
    turns: int
    """Sampled assistant turns."""
    finish_reason: str
    """"done" (the environment ended it), "max_turns" or "max_context"."""
    prompt_length: int
    actions: tuple[str, ...]
    """Decoded text of each sampled turn, as the environment received it."""
    observations: tuple[str, ...]
    """The reset observation, then the environment's answer to each action."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """The environment's step infos merged (flags: illegal, unparsable, tool_error; outcome)."""
    turn_rewards: tuple[float, ...] = ()
    """The environment's reward for each sampled turn (per-turn credit: format rewards, the
    outcome on the last turn); ``len(turn_rewards) == turns``."""
    observation_roles: tuple[str, ...] = ()
    """The chat role of each observation ("user" for the reset observation, then each
    StepResult.role); ``len(observation_roles) == len(observations)``."""
    routes: Any = field(default=None, compare=False)
    """MoE routing replay: int16 [len(token_ids) - 1, layers, topk], the experts the rollout
    routed each input token to, in the first forward that fed it (rollout/routing_replay.py
    ``extend``: a later turn's re-prefill does not overwrite them); None unless the engine
    records routes."""
    versions: tuple[int, ...] = ()
    """The policy version (train steps before it) of the weights that sampled each token; -1
    where loss_mask is 0. An episode carried across rollout stages has several."""

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class LiveEpisode:
    """One episode while it is played: mutable, frozen into an Episode when it ends. A live
    episode may outlast a rollout stage (``play_turns`` hands back the unfinished ones; the
    trainer carries them into the next stage: trainer/episode_pool.py). ``env`` is its
    environment, stepped to the episode's state; everything else is plain data, so an episode
    moves between ranks as that data and its environment is rebuilt by ``replay_env``."""
    env: Env
    seed: int
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    observations: list[str]
    prompt_length: int
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token; -1 where loss_mask is 0."""
    actions: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=lambda: ["user"])
    info: dict = field(default_factory=dict)
    reward: float = 0.0
    turns: int = 0
    turn_rewards: list = field(default_factory=list)
    routes: Any = None
    """MoE routing replay: the experts of every token fed so far (Episode.routes)."""
    key: Any = None
    """The caller's name for the episode (the trainer's: its start iteration and index)."""

    def append(self, tokens: Sequence[int], mask: int, logprobs: Sequence[float] | None = None,
               version: int = -1):
        self.tokens.extend(tokens)
        self.mask.extend([mask] * len(tokens))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))
        self.versions.extend([version if mask else -1] * len(tokens))

    def freeze(self, finish_reason: str) -> Episode:
        return Episode(env=self.env.name, seed=self.seed, token_ids=tuple(self.tokens),
                       loss_mask=tuple(self.mask), logprobs=tuple(self.logprobs),
                       reward=self.reward, turns=self.turns, finish_reason=finish_reason,
                       prompt_length=self.prompt_length, actions=tuple(self.actions),
                       observations=tuple(self.observations), info=dict(self.info),
                       turn_rewards=tuple(self.turn_rewards),
                       observation_roles=tuple(self.roles), routes=self.routes,
                       versions=tuple(self.versions))

    def data(self) -> dict:
        """Everything but the environment: what moves between ranks and into a checkpoint
        (MoE routes included: the next turn keeps them for the tokens already fed)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "env"}


def replay_env(env: Env, seed: int, actions: Sequence[str]) -> Env:
    """``env`` reset to ``seed`` and stepped through ``actions``: the state a live episode's
    environment had. Exact for every environment whose episode is a pure function of (seed,
    actions), as the built-in ones are (envs/base.py); a tool with side effects would run
    again."""
    env.reset(seed)
    for a in actions:
        env.step(a)
    return env


def start_episode(env: Env, seed: int, tokenizer, config: AgentLoopConfig,
                  key: Any = None) -> LiveEpisode | Episode:
    """The episode's prompt (reset observation under the chat template), live; or the Episode
    ended "max_context" when the prompt leaves no room for a turn."""
    obs = env.reset(seed)
    prompt = render_prompt(tokenizer, env.system_prompt, obs)
    live = LiveEpisode(env, int(seed), list(prompt), [0] * len(prompt), [0.0] * len(prompt),
                       [obs], len(prompt), versions=[-1] * len(prompt), key=key)
    if len(prompt) > config.max_context_tokens - config.max_action_tokens:
        return live.freeze("max_context")
    return live


def run_episodes(engine: RolloutEngine, envs: Sequence[Env], seeds: Sequence[int], tokenizer,
                 config: AgentLoopConfig = AgentLoopConfig(), *,
                 should_stop: Optional[Callable[[], bool]] = None,
                 env_concurrency: int = 1, version: int = 0,
                 progress: Optional[Callable[[int, int], None]] = None) -> list[Episode]:
    """Play one episode per (env, seed) to the end; Episodes come back in input order.

    ``envs`` must be distinct objects (an environment holds one episode's state); ``tokenizer``
    is an HF tokenizer with a chat template (``char_tokenizer()`` or a real one).
    ``progress`` (optional) is called with (episodes ended, episodes) before the first turn and
    after every turn, on this rank alone (an evaluation's live view).
    """
    if len(envs) != len(seeds):
        raise ValueError(f"got {len(envs)} environments and {len(seeds)} seeds; need one seed "
                         "per environment")
    if len({id(e) for e in envs}) != len(envs):
        raise ValueError("the same environment object appears twice; make one per episode "
                         "(e.g. [make_env(name) for _ in seeds])")
    started = [start_episode(env, seed, tokenizer, config, key=i)
               for i, (env, seed) in enumerate(zip(envs, seeds))]
    results = {i: e for i, e in enumerate(started) if isinstance(e, Episode)}
    live = [e for e in started if isinstance(e, LiveEpisode)]
    on_turn = None if progress is None else \
        (lambda ended: progress(len(results) + ended, len(envs)))
    finished, _ = play_turns(engine, live, tokenizer, config, version=version,
                             should_stop=should_stop, env_concurrency=env_concurrency,
                             on_turn=on_turn)
    results.update((e_key, ep) for e_key, ep in finished)
    return [results[i] for i in range(len(envs))]


def play_turns(engine: RolloutEngine, live: Sequence[LiveEpisode], tokenizer,
               config: AgentLoopConfig, *, version: int = 0,
               should_stop: Optional[Callable[[], bool]] = None,
               enough: Optional[Callable[[list], bool]] = None,
               env_concurrency: int = 1, on_turn: Optional[Callable[[int], None]] = None
               ) -> tuple[list[tuple[Any, Episode]], list[LiveEpisode]]:
    """Turns of every live episode, batched, until all have ended or ``enough(finished)``
    (the (key, Episode) pairs ended so far, in the order they ended; checked after every turn)
    says the stage has what it needs. Returns (finished, still live): the still-live episodes
    stop at a turn boundary and continue in a later call, under whatever weights the engine then
    has. Turn t of a call samples with ``turn_sample_seed(config.seed, t)``; every token sampled
    here is recorded as sampled by ``version``.

    The environments of a turn step concurrently on ``env_concurrency`` threads (1: one after
    another): a slow tool's wait overlaps across episodes; each environment still sees its own
    actions in order, and results are taken in episode order, so the outcome does not depend on
    which step returns first. ``on_turn`` (optional) is called with the number of episodes
    ended so far before the first turn and after every turn (a progress display; local).
    """
    fmt = chat_format(tokenizer)
    end_of_turn_id = fmt.stop_token_ids[0]
    room = config.max_context_tokens - config.max_action_tokens
    finished: list[tuple[Any, Episode]] = []
    active = list(live)
    pool = ThreadPoolExecutor(env_concurrency, thread_name_prefix="env-step") \
        if env_concurrency > 1 else None
    turn = 0
    try:
        if on_turn is not None:
            on_turn(0)
        while active and not (enough is not None and enough(finished)):
            if should_stop is not None and should_stop():
                raise RolloutAbandoned(f"stopped before turn {turn} ({len(active)} episodes "
                                       "live)", finished)
            params = SamplingParams(temperature=config.temperature, top_p=config.top_p,
                                    max_new_tokens=config.max_action_tokens,
                                    stop_token_ids=fmt.stop_token_ids,
                                    seed=turn_sample_seed(config.seed, turn))
            generations = engine.generate([ep.tokens for ep in active], params)
            if len(generations) != len(active):
                raise RuntimeError(f"engine returned {len(generations)} generations for "
                                   f"{len(active)} prompts; it breaks the RolloutEngine contract")
            actions = [tokenizer.decode(list(gen.token_ids), skip_special_tokens=True)
                       for gen in generations]
            steps = list(pool.map(lambda ea: ea[0].env.step(ea[1]),
                                  zip(active, actions))) if pool is not None else \
                [ep.env.step(a) for ep, a in zip(active, actions)]
            still = []
            for ep, gen, action, result in zip(active, generations, actions, steps):
                ep.append(gen.token_ids, 1, gen.logprobs, version)
                ep.routes = routing_replay.extend(ep.routes, gen.routes)
                ep.turns += 1
                ep.actions.append(action)
                ep.observations.append(result.observation)
                ep.roles.append(result.role)
                ep.reward += result.reward
                ep.turn_rewards.append(float(result.reward))
                ep.info.update(result.info)
                if result.done:
                    finished.append((ep.key, ep.freeze("done")))
                    continue
                if ep.turns >= config.max_turns:
                    finished.append((ep.key, ep.freeze("max_turns")))
                    continue
                # the turn counts as closed by the template only if it ended with end-of-turn;
                # a turn cut by max_action_tokens (or ended by EOS) gets the end-of-turn token
                # as a template token with loss mask 0
                stopped = bool(gen.token_ids) and gen.token_ids[-1] == end_of_turn_id
                nxt = render_next_turn(tokenizer, fmt, result.observation, stopped, result.role)
                if len(ep.tokens) + len(nxt) > room:
                    finished.append((ep.key, ep.freeze("max_context")))
                    continue
                ep.append(nxt, 0)
                still.append(ep)
            active = still
            turn += 1
            if on_turn is not None:
                on_turn(len(finished))
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return finished, active


@dataclass(frozen=True)
class RolloutMetrics:
    episodes: int
    mean_reward: float
    win_rate: float
    draw_rate: float
    loss_rate: float
    """Fractions of all episodes whose game ended in that outcome (bad actions count in none)."""
    illegal_rate: float
    unparsable_rate: float
    tool_error_rate: float
    """Fractions of episodes with the flag set."""
    mean_context_tokens: float
    max_context_tokens: int
    mean_turns: float
    policy_tokens: int
    finish_reasons: Mapping[str, int]


def summarize(episodes: Sequence[Episode]) -> RolloutMetrics:
    n = len(episodes)
    if n == 0:
        raise ValueError("summarize() needs at least one episode")

    def rate(pred) -> float:
        return sum(1 for e in episodes if pred(e)) / n

    return RolloutMetrics(
        episodes=n,
        mean_reward=sum(e.reward for e in episodes) / n,
        win_rate=rate(lambda e: e.info.get("outcome") == "win"),
        draw_rate=rate(lambda e: e.info.get("outcome") == "draw"),
        loss_rate=rate(lambda e: e.info.get("outcome") == "loss"),
        illegal_rate=rate(lambda e: e.info.get("illegal", False)),
        unparsable_rate=rate(lambda e: e.info.get("unparsable", False)),
        tool_error_rate=rate(lambda e: e.info.get("tool_error", False)),
        mean_context_tokens=sum(len(e.token_ids) for e in episodes) / n,
        max_context_tokens=max(len(e.token_ids) for e in episodes),
        mean_turns=sum(e.turns for e in episodes) / n,
        policy_tokens=sum(e.num_policy_tokens for e in episodes),
        finish_reasons=dict(Counter(e.finish_reason for e in episodes)),
    )
