"""When nothing fits: the selector's two errors and the changes it checked would make a layout fit.

``NoLayoutFitsError`` (auto: no valid layout fits a stage) carries ``suggestions``, each a
change the selector re-planned with and found a fitting layout for (never a guess):

    "<n> nodes (<d> devices), e.g. <layout> at <bytes>"   more nodes of the same kind
    "recompute=<mode>, e.g. ..."        TRAIN, when the recompute mode is fixed (not auto)
    "micro_batch_tokens=<n>, e.g. ..."  TRAIN / LOGPROB micro-batch budget (>= one sequence)
    "prefill_tokens=<n>, e.g. ..."      ROLLOUT prefill chunk
    "responses_in_flight=<n>"           ROLLOUT responses submitted at once
    "contexts up to <n> tokens (now <m>)"

The trainer turns each into the configuration key that makes it (train.py ``layout_fix``).
``LayoutOverBudgetError``: a static layout over the budget.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from earl_megatron.plan.memory_model import MemoryEstimate
from earl_megatron.plan.specs import Recompute, Stage, StageWorkload, human_bytes


class NoLayoutFitsError(RuntimeError):
    """No valid layout fits; ``suggestions`` are changes checked to make one fit."""

    def __init__(self, stage: Stage, budget_bytes: int, smallest: Optional[MemoryEstimate],
                 suggestions: tuple[str, ...]):
        self.stage, self.budget_bytes, self.smallest = stage, budget_bytes, smallest
        self.suggestions = suggestions
        need = smallest.describe() if smallest else "no valid layout at all"
        fixes = "; ".join(suggestions) if suggestions else (
            "nothing checked fits (up to 64x the devices, recompute, a smaller micro-batch, fewer "
            "responses, shorter contexts): the weights and optimizer state alone are too large")
        super().__init__(f"no layout fits stage {stage.value} in {human_bytes(budget_bytes)} per "
                         f"rank; the smallest is {need}. Would fit: {fixes}")


class LayoutOverBudgetError(RuntimeError):
    """A fixed (static) layout does not fit the budget: what a GPU run would hit as an OOM."""

    def __init__(self, estimate: MemoryEstimate, budget_bytes: int, longest: int):
        self.estimate, self.budget_bytes, self.longest = estimate, budget_bytes, longest
        st, lay = estimate.stage.value, estimate.layout
        super().__init__(
            f"static layout {lay} for stage {st} needs {estimate.describe()} per rank for "
            f"contexts up to {longest} tokens, over the {human_bytes(budget_bytes)} budget: "
            f"use layout=auto (the selector moves to a layout that fits as contexts grow), a "
            f"static layout.{st}= with more tp, cp or pp, or a larger layout.memory_budget_gb")


def suggestions(selector, workload: StageWorkload, resident_bytes: int) -> tuple[str, ...]:
    """Changes checked to make a layout of ``selector`` (a Selector) fit ``workload``, in the
    selector's words (module docstring); the first that fits of each kind."""
    out = []
    for k in (2, 4, 8, 16, 32, 64):
        cluster = selector.cluster
        bigger = replace(selector, cluster=cluster.with_(nodes=cluster.nodes * k))
        fit = bigger.fits_somewhere(workload, resident_bytes)
        if fit is not None:
            out.append(f"{bigger.cluster.nodes} nodes ({bigger.cluster.world_size} devices), "
                       f"e.g. {fit.layout} at {human_bytes(fit.total)}")
            break
    if workload.stage is Stage.TRAIN and not selector.config.auto_recompute:
        order = [Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL]
        for rc in order[order.index(selector.train_opts.recompute) + 1:]:
            other = replace(selector, train_opts=selector.train_opts.with_(recompute=rc))
            fit = other.fits_somewhere(workload, resident_bytes)
            if fit is not None:
                out.append(f"recompute={rc.value}, e.g. {fit.layout} at "
                           f"{human_bytes(fit.total)}")
                break
    # A TRAIN/LOGPROB micro-batch holds at least one whole sequence; rollout chunks prefill.
    floor = 1 if workload.stage is Stage.ROLLOUT else workload.max_context
    mb = workload.micro_batch_tokens
    while mb > floor and mb > 1:
        mb //= 2
        fit = selector.fits_somewhere(workload.with_(micro_batch_tokens=mb), resident_bytes)
        if fit is not None:
            key = "prefill_tokens" if workload.stage is Stage.ROLLOUT else "micro_batch_tokens"
            out.append(f"{key}={mb}, e.g. {fit.layout} at {human_bytes(fit.total)}")
            break
    if workload.stage is Stage.ROLLOUT and workload.responses_in_flight > 1:
        r = _largest(lambda n: selector.fits_somewhere(
            workload.with_(responses_in_flight=n), resident_bytes) is not None,
            1, workload.responses_in_flight - 1)
        if r:
            out.append(f"responses_in_flight={r}")
    if workload.max_context > 1:
        top = workload.contexts[-1][0]
        s = _largest(lambda n: selector.fits_somewhere(
            workload.scaled_to(n).with_(predicted_context=0), resident_bytes) is not None,
            1, workload.max_context - 1)
        if s and s < top:
            out.append(f"contexts up to {s} tokens (now {workload.max_context})")
    return tuple(out)

def _largest(ok, lo: int, hi: int) -> int:
    """Largest n in [lo, hi] with ok(n), assuming ok is monotone (true then false); 0 if none."""
    if hi < lo or not ok(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
