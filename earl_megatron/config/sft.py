"""The supervised warm start's configuration (the ``sft`` section of a recipe): one frozen value.

``steps = 0`` turns the warm start off. Traces come from ``data`` (a JSONL file of chat
trajectories, rollout/trajectories.py) or, when it is null, from the environment's scripted
expert (``env.expert(seed)``) on ``expert_episodes`` seeds of their own (never an RL or an
evaluation seed). Every field is validated here (a ``ConfigError`` naming ``sft.<key>``), so a
bad value stops the run before any model is built; that ``data`` is a readable file is checked
by train.validate before any process group work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from earl_megatron.config.checks import ConfigError, at_least, require_finite


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 0
    """Optimizer steps of the warm start before RL (0: none, RL starts from the initial policy)."""
    data: Optional[str] = None
    """JSONL file of chat trajectories; null: play the environment's expert."""
    expert_episodes: int = 512
    """Traces the expert plays when data is null (each step draws batch_size of them)."""
    batch_size: int = 32
    """Trajectories per optimizer step; at most the number of traces."""
    lr: Optional[float] = None
    """Learning rate of the warm start (null: algorithm.lr); RL continues at algorithm.lr."""
    log_every: int = 10
    """Steps between lines of the live view and entries of sft.jsonl (the last step always)."""

    def __post_init__(self):
        require_finite(self, "sft")
        if self.steps < 0:
            raise ConfigError(f"sft.steps={self.steps}: use 0 (no warm start) or more")
        at_least(self, "sft", 1, "batch_size", "expert_episodes", "log_every")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"sft.lr={self.lr} must be > 0 (or null: algorithm.lr)")
        if self.data is None and self.steps and self.batch_size > self.expert_episodes:
            raise ConfigError(f"sft.batch_size={self.batch_size} > sft.expert_episodes="
                              f"{self.expert_episodes}: a step cannot draw more traces than exist")
