"""Which layouts a rollout engine decodes in: the one place for these rules (pure).

- Every engine decodes with cp = 1: no decoder here splits a sequence over ranks while it
  generates (Megatron-Core's inference engines and SGLang do not), and rollout replicas hold
  whole episodes, which the dispatcher's producer placement relies on. A stage that only decodes
  (the evaluation) spends a layout's cp ranks on dp (``decode_layout``).
- SGLang servers are tp x dp: pp = 1 as well (a server's expert parallelism comes from its own
  tp ranks, SGLang's --ep-size).

The selector enumerates only such ROLLOUT candidates (plan/selector.py); a static layout, an
engine built on a layout and the trainer's checks ask ``rollout_layout_problem``.
"""

from __future__ import annotations

from typing import Optional

from earl_megatron.plan.layout import ParallelLayout

ENGINES = ("embedded", "sglang")


def rollout_layout_problem(layout: ParallelLayout, engine: str) -> Optional[str]:
    """Why ``engine`` cannot decode in ``layout``, with the fix; None: it can."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: use one of {list(ENGINES)}")
    if layout.cp != 1:
        return (f"{layout} has cp={layout.cp}, but rollouts decode with cp=1 (no engine splits "
                f"a sequence while generating); spend those ranks on tp or dp, e.g. "
                f"{ParallelLayout(tp=layout.tp, pp=layout.pp, dp=layout.dp * layout.cp)}")
    if engine == "sglang" and layout.pp != 1:
        return (f"{layout} has pp={layout.pp}, but SGLang servers take tp x dp layouts (pp=1); "
                f"use e.g. tp{layout.tp * layout.pp} or dp{layout.dp * layout.pp}")
    return None


def decode_layout(layout: ParallelLayout) -> ParallelLayout:
    """``layout`` with its cp ranks spent on dp (experts whole on each rank): where a stage that
    only decodes runs the policy of ``layout``."""
    return ParallelLayout(tp=layout.tp, pp=layout.pp, dp=layout.dp * layout.cp)
