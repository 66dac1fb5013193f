"""The RL stages and the phases an iteration is timed by: one definition for the whole package.

    ROLLOUT -> LOGPROB -> TRAIN     (each planned in a layout of its own; glossary: "stage")

``STAGE_NAMES`` is their loop order, as keys of configuration (``layout.<stage>``) and of every
iteration's record (``layouts``, ``predicted_memory_gb``); ``ITERATION_TIMERS`` is the order of
the record's ``seconds`` (trainer/runner.py times exactly these, checked in
tests/distributed/test_algorithms.py), which the report stacks and the live view shows.
"""

from __future__ import annotations

from enum import Enum


class Stage(Enum):
    """An RL step. Each gets its own layout."""

    ROLLOUT = "rollout"
    """Multi-turn generation: prefill prompts/observations, decode responses with a KV cache."""
    LOGPROB = "logprob"
    """Forward-only scoring of finished episodes (old policy / reference policy)."""
    TRAIN = "train"
    """Forward + backward + optimizer step."""


STAGE_NAMES = tuple(s.value for s in Stage)
"""("rollout", "logprob", "train"): the loop order."""

ITERATION_TIMERS = ("plan+switch", "rollout", "old_logprob", "logprob", "critic_switch",
                    "values", "switch", "train", "critic_train", "weight_sync")
"""The phases of one iteration, in loop order: planning and moving to the rollout layout, the
rollout, the policy's re-scoring of its episodes (old logprobs), the reference's scoring,
moving the critic to the batch's TRAIN layout and its values (PPO), moving to the train layout,
the train step, the critic's train step (PPO), the weight sync to the rollout engine. A
record's ``seconds`` also holds their ``total``."""
