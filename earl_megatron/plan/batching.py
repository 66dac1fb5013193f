"""Length-grouped micro-batches: which samples train together, and how long each batch is.

Without packed sequences (THD attention needs TransformerEngine), a micro-batch is padded to its
longest sample. Padding every sample of an RL batch to the batch's longest episode wastes most of
the work once a few episodes grow long (attention is quadratic in the padded length). So:

1. samples are sorted by length (longest first, ties by id) and cut into micro-batches of
   neighbours, each of at most ``micro_batch_size`` samples and, when ``max_tokens`` is given,
   at most ``max_tokens`` padded tokens (a longer sample trains alone): each micro-batch holds
   samples of similar lengths, and activation memory follows the longest sample, not
   ``micro_batch_size`` times it;
2. a micro-batch's length is its longest sample rounded up to ``multiple`` (CP splits every
   sample into 2 * cp equal chunks, so every sample of a micro-batch gets this one length);
3. micro-batches go to DP ranks longest-processing-time first by ``micro_batch_cost``, each rank
   taking at most ``ceil(M / dp)`` of them, so DP ranks run (nearly) equal numbers of
   micro-batches of (nearly) equal cost.

Invariants (tests/unit/test_batching.py): every sample is in exactly one micro-batch of exactly
one DP rank; no micro-batch has more than ``micro_batch_size`` samples, nor more than
``max_tokens`` padded tokens unless it holds a single sample; each sample's padded
length is at least its length, a multiple of ``multiple``, and the same for all samples of its
micro-batch; the plan is a pure function of its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

ATTENTION_CROSSOVER = 1024
"""Padded length at which a micro-batch's attention costs as much as the rest of its layers;
it only weighs long micro-batches against many short ones when balancing DP ranks."""


def micro_batch_cost(samples: int, length: int) -> float:
    """Relative cost of a micro-batch: tokens, with attention's quadratic term."""
    return samples * length * (1.0 + length / ATTENTION_CROSSOVER)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class MicroBatchPlan:
    assignment: tuple[tuple[tuple[int, ...], ...], ...]
    """``assignment[dp_rank][mb]`` = sample ids, the longest micro-batches first."""
    lengths: tuple[tuple[int, int], ...]
    """(sample id, padded length): the length every tensor of that sample is built with."""

    @property
    def length_of(self) -> dict[int, int]:
        return dict(self.lengths)

    def micro_batch_lengths(self, dp_rank: int) -> list[int]:
        length = self.length_of
        return [length[mb[0]] for mb in self.assignment[dp_rank]]

    @property
    def longest(self) -> int:
        """The longest micro-batch's padded length."""
        return max(length for _, length in self.lengths)

    @property
    def max_rows(self) -> int:
        """Samples in the fullest micro-batch (Megatron's schedule takes one size)."""
        return max(len(mb) for per_dp in self.assignment for mb in per_dp)

    @property
    def padded_tokens(self) -> int:
        return sum(self.length_of.values())


def plan_micro_batches(lengths: Mapping[int, int], dp: int, micro_batch_size: int,
                       multiple: int = 1, max_tokens: Optional[int] = None) -> MicroBatchPlan:
    """Length-grouped micro-batches over ``dp`` ranks for samples of ``lengths`` (predictions)."""
    if dp < 1 or micro_batch_size < 1 or multiple < 1 or (max_tokens is not None
                                                           and max_tokens < 1):
        raise ValueError(f"plan_micro_batches: dp={dp}, micro_batch_size={micro_batch_size}, "
                         f"multiple={multiple} and max_tokens={max_tokens} must be >= 1")
    if len(lengths) < dp:
        raise ValueError(f"{len(lengths)} samples cannot feed dp={dp}: every DP rank needs at "
                         "least one; raise the episodes per iteration or lower dp")
    order = sorted(lengths, key=lambda s: (-lengths[s], s))
    # at least one micro-batch per dp rank: shrink the batch size when there are few samples
    per = min(micro_batch_size, len(order) // dp)
    groups: list[tuple[int, ...]] = []
    cur: list[int] = []
    for s in order:
        width = round_up(max(lengths[cur[0]] if cur else lengths[s], 1), multiple)
        if cur and (len(cur) == per or (max_tokens is not None
                                        and (len(cur) + 1) * width > max_tokens)):
            groups.append(tuple(cur))
            cur = []
        cur.append(s)
    groups.append(tuple(cur))
    padded = {s: round_up(max(lengths[g[0]], 1), multiple) for g in groups for s in g}
    cap = -(-len(groups) // dp)
    load = [0.0] * dp
    out: list[list[tuple[int, ...]]] = [[] for _ in range(dp)]
    for g in groups:  # longest first: LPT greedy under the per-rank cap
        free = [d for d in range(dp) if len(out[d]) < cap]
        d = min(free, key=lambda r: (load[r], len(out[r]), r))
        out[d].append(g)
        load[d] += micro_batch_cost(len(g), padded[g[0]])
    return MicroBatchPlan(assignment=tuple(tuple(mbs) for mbs in out),
                          lengths=tuple(sorted(padded.items())))
