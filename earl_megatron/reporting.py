"""Bad input as the command line reports it: one line from rank 0 and exit status 2, never a
traceback (``reporting_errors``), and for a layout that does not fit, the configuration keys that
would make one fit (``layout_fix``). train.py and cli.py report through it."""

from __future__ import annotations

import math
import os
import sys

from earl_megatron.config.train import ConfigError, TrainConfig


def _fail(kind: str, e: Exception, fix: str = "") -> None:
    """One line from rank 0 (every rank raises the same error), exit status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{kind}: {' '.join(str(e).split())}{fix}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def layout_fix(e, cfg: TrainConfig) -> str:
    """The config keys that make a layout fit, after a NoLayoutFitsError or a
    LayoutOverBudgetError (whose own text is in the selector's terms): the per-rank budget the
    smallest layout needs, then each change the selector checked would fit, as the key that
    makes it (every suggestion the selector makes has one; SGLang's prefill chunk is the
    servers' own flag, so it is left to the selector's text)."""
    import re

    from earl_megatron.plan.selector import NoLayoutFitsError
    from earl_megatron.plan.specs import human_bytes

    auto = isinstance(e, NoLayoutFitsError)
    need = (e.smallest.total if e.smallest else None) if auto else e.estimate.total
    lay, fixes = cfg.layout, []
    if need is not None:
        gb = math.ceil(need / (1 - lay.memory_margin) / 2**30 * 100) / 100
        now = f"{lay.memory_budget_gb:g}" if lay.memory_budget_gb is not None else \
            f"null, the cluster.preset={cfg.cluster.preset} device's memory"
        fixes.append(f"layout.memory_budget_gb={gb:g} or more (now {now}; the smallest layout "
                     f"needs {human_bytes(need)} and layout.memory_margin="
                     f"{lay.memory_margin:g} stays free)")
    for text in (e.suggestions if auto else ()):
        if m := re.match(r"(\d+) nodes \((\d+) devices\)", text):
            fixes.append(f"{m[2]} ranks (cluster.nodes={m[1]} x "
                         f"{int(m[2]) // int(m[1])} per node)")
        elif m := re.match(r"micro_batch_tokens=(\d+)", text):
            fixes.append(f"algorithm.micro_batch_tokens={m[1]}")
        elif (m := re.match(r"prefill_tokens=(\d+)", text)) and cfg.rollout.engine == "embedded":
            fixes.append(f"rollout.prefill_tokens={m[1]}")     # SGLang chunks by its own flag
        elif m := re.match(r"recompute=(\w+)", text):
            fixes.append(f"layout.recompute={m[1]} (or auto: the selector picks per iteration)")
        elif m := re.match(r"responses_in_flight=(\d+)", text):
            # in flight: (k + 1) batches under asynchronous RL (algorithm.max_staleness = k)
            k = cfg.algorithm.max_staleness
            batch = int(m[1]) // (k + 1) // cfg.algorithm.group_size * cfg.algorithm.group_size
            if batch >= 1:
                fixes.append(f"rollout.episodes_per_iteration={batch}")
            if k:
                fixes.append(f"algorithm.max_staleness={k - 1} (fewer batches in flight)")
        elif m := re.match(r"contexts up to (\d+) tokens", text):
            fixes.append(f"rollout.max_context_tokens={m[1]}")
    return ". Fix: " + "; or ".join(fixes) if fixes else ""


def reporting_errors(fn, *args):
    """``fn(*args)`` with the command line's handling of bad input: a ConfigError, a damaged
    checkpoint or a model no layout fits is one line from rank 0 (``configuration error: ...``,
    ``checkpoint error: ...``, ``layout error: ...``) and SystemExit(2) on every rank, never a
    traceback. A layout error of ``run(cfg)`` ends with the config keys that fix it
    (``layout_fix``). Anything else is a bug and keeps its traceback."""
    from earl_megatron.plan.selector import LayoutOverBudgetError, NoLayoutFitsError
    from earl_megatron.runtime.io_errors import CheckpointError

    try:
        return fn(*args)
    except ConfigError as e:
        _fail("configuration error", e)
    except CheckpointError as e:
        _fail("checkpoint error", e)
    except (NoLayoutFitsError, LayoutOverBudgetError) as e:
        cfg = next((a for a in args if isinstance(a, TrainConfig)), None)
        _fail("layout error", e, layout_fix(e, cfg) if cfg is not None else "")
