"""The ``algorithm.critic`` section (PPO's value model, issue #45). Pure Python.

``CriticConfig`` is read only under ``algorithm.name=ppo`` (config/algorithm.py refuses its keys
at anything but their defaults under another estimator, and checks them under ppo with
``_check``: each bad value one ``ConfigError`` naming ``algorithm.critic.<key>`` and the fix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from earl_megatron.config.checks import ConfigError


@dataclass(frozen=True)
class CriticConfig:
    """The ``algorithm.critic`` section: PPO's value model (models/value_model.py,
    trainer/critic.py). Read only under ``algorithm.name=ppo``; another estimator refuses a
    value other than the defaults (it trains no critic)."""

    lr: float = 1e-3
    """The critic's Adam learning rate (its own Megatron optimizer; weight_decay and clip_grad
    are the policy's)."""
    clip: Optional[float] = 0.2
    """Value clipping: the new value is kept within ``clip`` of the value the batch was scored
    with (PPO2's clipped value loss, rl/value.py); null: the plain squared error."""
    warmup: int = 0
    """Iterations at the start of the run that train only the critic (the policy is not
    updated, its weights stay those the rollout played with) before the policy uses it."""
    init: Optional[str] = None
    """Where the critic starts, of the policy's architecture (null: the policy's initial
    weights, run.init or the seed's init, and a new value head). An HF causal LM or a converted
    policy: its trunk, a new head. An HF value model (``earl convert mcore-to-hf CKPT OUT
    --critic``'s OUT, or a ForTokenClassification / ForSequenceClassification reward model with
    one label) or a PPO run's checkpoint (its ``critic/``): trunk and head
    (weights/critic_import.py)."""

    def _check(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"algorithm.critic.lr={self.lr} must be > 0 (e.g. 1e-5 for a "
                              "real model, 1e-3 for the tiny one)")
        if self.clip is not None and not self.clip > 0:
            raise ConfigError(f"algorithm.critic.clip={self.clip} must be > 0 (or null: no "
                              "value clipping)")
        if isinstance(self.warmup, bool) or self.warmup < 0:
            raise ConfigError(f"algorithm.critic.warmup={self.warmup} must be an integer >= 0 "
                              "(iterations that train only the critic)")
        if self.init is not None and not str(self.init).strip():
            raise ConfigError("algorithm.critic.init is empty: give a directory (an HF "
                              "directory or converted checkpoint), or null for the policy's "
                              "initial weights")
