"""The environment interface the agent loop drives: text in, text out, one reward per step.

An environment is a small stateful object (one episode at a time):

    obs = env.reset(seed)            # observation text of the first turn
    res = env.step(action_text)      # StepResult(observation, reward, done, info)
    ...                              # until res.done

Invariants every environment keeps (tests check them for the built-in ones):

- ``step`` never raises on model output. An action that cannot be parsed, or that is not legal,
  ends the episode with ``reward = invalid_penalty`` and sets ``info["unparsable"]`` or
  ``info["illegal"]`` to True, so the run goes on and the metrics can count it.
- ``reset(seed)`` is deterministic: the same seed gives the same first observation and, with the
  same actions, the same episode (opponents and question generators draw only from that seed).
- Rewards are from the agent's point of view. Games: +1 win, 0 draw, -1 loss; an episode that ends
  in a game result sets ``info["outcome"]`` to "win", "draw" or "loss".
- ``system_prompt`` is the fixed task description the loop renders as the system turn (may be
  empty: then no system turn is rendered, and a template with a default system prompt, such as
  SmolLM2's ChatML, inserts its own). Observation and system texts carry loss mask 0.
- ``StepResult.role`` says which chat role the observation is rendered in: "user" (default) or
  "tool" for a tool's result; the first observation (``reset``) is always a user turn.

``expert(seed)`` (optional) returns a scripted teacher's actions for the episode of that seed;
the supervised warm start plays them to make training traces.

Standard info keys (all optional): "illegal", "unparsable", "tool_error" (bool flags), "outcome"
(str), "tool_calls" (int). The agent loop merges a step's info into the episode's info.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Mapping

FLAG_KEYS = ("illegal", "unparsable", "tool_error")


@dataclass(frozen=True)
class StepResult:
    observation: str
    """What the environment says next (opponent's reply and board, tool output, final result)."""
    reward: float
    done: bool
    info: Mapping[str, Any] = field(default_factory=dict)
    role: str = "user"
    """The chat role the agent loop renders ``observation`` in: "user" for an environment's
    reply (a game's board), "tool" for a tool's result (the calculator's JSON format), so the
    chat template shows the model a tool message where it has one. Never "assistant" or
    "system": those turns are the policy's and the task's."""

    def __post_init__(self):
        if not isinstance(self.role, str) or not self.role or self.role in ("assistant",
                                                                             "system"):
            raise ValueError(f"StepResult.role={self.role!r}: an observation is rendered as a "
                             "user or tool message (any non-empty role but assistant/system)")


class EnvStateError(RuntimeError):
    """step() called before reset() or after the episode ended: a bug in the caller, not the
    model, so this one does raise."""


class Env(abc.ABC):
    """Base class for text environments; subclasses implement ``_reset`` and ``_step``.

    The base class owns the episode bookkeeping (reset before step, no step after done) so every
    environment reports misuse with the same error.
    """

    name: str = "env"

    def __init__(self, invalid_penalty: float = -1.0):
        self.invalid_penalty = float(invalid_penalty)
        self._live = False

    @property
    @abc.abstractmethod
    def system_prompt(self) -> str:
        """Task description and action format, rendered once as the system turn."""

    def reset(self, seed: int) -> str:
        obs = self._reset(int(seed))
        self._live = True
        return obs

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise EnvStateError(f"{self.name}: step() called with no live episode; call "
                                "reset(seed) first (and do not step after done=True)")
        result = self._step(action)
        if result.done:
            self._live = False
        return result

    def expert(self, seed: int) -> list[str]:
        """A scripted teacher's actions for the whole episode ``reset(seed)`` starts (the
        supervised warm start's traces); environments without one say so."""
        raise NotImplementedError(f"environment {self.name!r} has no scripted expert; give the "
                                  "supervised warm start a JSONL file of chat trajectories "
                                  "instead (sft.data=PATH, docs/trainer.md)")

    def invalid(self, flag: str, observation: str, **info: Any) -> StepResult:
        """End the episode on bad model output: penalty reward, the flag set in info."""
        if flag not in FLAG_KEYS:
            raise ValueError(f"unknown flag {flag!r}; use one of {FLAG_KEYS}")
        return StepResult(observation=observation, reward=self.invalid_penalty, done=True,
                          info={flag: True, **info})

    @abc.abstractmethod
    def _reset(self, seed: int) -> str:
        ...

    @abc.abstractmethod
    def _step(self, action: str) -> StepResult:
        ...
