"""Every seed a run draws, from run.seed: one function per stream, one place for its formula.

Environment seeds (which game or question an episode plays) come in three streams that must
never meet inside a run, or an evaluation would replay a training game and a warm start would
train on an evaluation question:

    RL iteration i, episode k       run_seed * 1_000_003 + i * 10_007 + k // group_size
    evaluation episode k            10**9    + run_seed * 100_003 + k
    warm-start expert trace k       3 * 10**9 + run_seed * 100_003 + k

Invariant (tests/unit/test_seeds.py, by interval arithmetic over the whole domain): for
``run_seed < MAX_RUN_SEED``, at most ``MAX_ITERATIONS`` iterations of at most
``ITERATION_STRIDE`` episodes, and at most ``EVAL_STRIDE`` evaluation episodes or expert traces,
the three streams are disjoint and no two iterations of one run share a seed (GRPO's groups
share one on purpose). A resumed run draws the same seeds: each is a pure function of
(run_seed, iteration, index).

Sampling seeds (the random numbers of token sampling) are other streams: ``rollout_sample_seed``
per RL iteration and ``EVAL_SAMPLE_SEED`` for every evaluation (the same draws before and after
training, so evaluations compare policies, not luck), ``turn_sample_seed`` per turn of an agent
loop call (``round_sample_seed``: per extra round of dynamic sampling), and ``row_sample_seed``
per prompt row of the embedded engine, so a row's samples depend neither on its batch mates nor
on the dp split.
"""

from __future__ import annotations

RUN_STRIDE = 1_000_003
ITERATION_STRIDE = 10_007
EVAL_BASE = 10**9
EXPERT_BASE = 3 * 10**9
EVAL_STRIDE = 100_003
MAX_RUN_SEED = 900
MAX_ITERATIONS = 9_000
EVAL_SAMPLE_SEED = 424242
_ROW_MODULUS = 2**63 - 1


def episode_seeds(run_seed: int, iteration: int, count: int, group_size: int = 1) -> list[int]:
    """Environment seeds of RL iteration ``iteration``: GRPO groups of ``group_size``
    consecutive episodes share a seed."""
    base = run_seed * RUN_STRIDE + iteration * ITERATION_STRIDE
    return [base + i // group_size for i in range(count)]


def evaluation_seeds(run_seed: int, count: int) -> list[int]:
    """Environment seeds of every evaluation (the same games at the start and the end)."""
    return [EVAL_BASE + run_seed * EVAL_STRIDE + i for i in range(count)]


def expert_seeds(run_seed: int, count: int) -> list[int]:
    """Environment seeds of the warm start's expert traces."""
    return [EXPERT_BASE + run_seed * EVAL_STRIDE + i for i in range(count)]


def rollout_sample_seed(run_seed: int, iteration: int) -> int:
    """The sampling seed of RL iteration ``iteration``'s rollout."""
    return run_seed * 7919 + iteration


ROUND_STRIDE = 10**7
"""Above every ``rollout_sample_seed`` (run_seed < MAX_RUN_SEED, iteration < MAX_ITERATIONS)."""


def round_sample_seed(call_seed: int, rnd: int) -> int:
    """The sampling seed of extra round ``rnd`` of dynamic sampling in a stage seeded
    ``call_seed`` (round 0: ``call_seed`` itself). A new round's episodes must not replay the
    draws of the round whose groups it replaces."""
    return call_seed + rnd * ROUND_STRIDE


def turn_sample_seed(call_seed: int, turn: int) -> int:
    """The sampling seed of one turn of an agent-loop call seeded ``call_seed`` (every episode
    of the batch decodes that turn with it)."""
    return call_seed * RUN_STRIDE + turn


def row_sample_seed(call_seed: int, row: int) -> int:
    """The generator seed of prompt ``row`` (its index in the whole call, over every dp replica)
    of an engine call seeded ``call_seed``."""
    return (call_seed * RUN_STRIDE + row) % _ROW_MODULUS
