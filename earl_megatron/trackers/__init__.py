"""The trackers a run's metrics are mirrored to (``run.loggers``): TensorBoard, Weights & Biases,
MLflow, Trackio and SwanLab, each through its own library, one small adapter module each.

    trackers = Trackers(cfg.run.loggers, out_dir, start=start, enabled=rank == 0,
                        say=view.message)
    with trackers.started(cfg.to_dict()):      # the resolved configuration, logged once
        trackers.log(rec)                      # each metrics.jsonl record, step = iteration
        trackers.log_eval("iter10", result, step=10)

Every adapter is a ``Tracker``: ``start(config)``, ``log(metrics, step)``, ``log_eval(metrics,
step)``, ``finish()``; ``metrics`` is a flat {key: float} dict (``flatten``: nested dicts such as
``seconds`` become ``seconds/train``, anything not a number is skipped) and an evaluation's keys
are ``eval/<opponent>/<mode>/<metric>`` (``eval_metrics``).

Invariants:
- metrics.jsonl stays the record: a tracker that raises is told once (``say``) and disabled;
  the run goes on with the others.
- Rank 0 only (``enabled=False`` makes every call a no-op), and no collective: nothing here
  waits on another rank.
- Offline by default: each adapter writes under the run's output directory unless the user's
  environment already points the tracker somewhere (``ENV``: the variables that do).
- A tracker whose package is missing is refused before any rank starts (``check_installed``,
  called from train.validate), in one line naming ``pip install earl_megatron[NAME]``.
- The constructor has no side effects: ``start`` imports the libraries and opens the runs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
from pathlib import Path
from typing import Callable, Iterable, Optional

from earl_megatron.config.checks import ConfigError
from earl_megatron.config.loggers import LOGGERS, check_names  # noqa: F401 - re-exported

ENV = {"tensorboard": (),
       "wandb": ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"),
       "mlflow": ("MLFLOW_TRACKING_URI",),
       "trackio": ("TRACKIO_DIR", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"),
       "swanlab": ("SWANLAB_MODE", "SWANLAB_API_KEY", "SWANLAB_LOG_DIR")}
"""The environment variables that point each tracker elsewhere than the run's directory (any
one set: the adapter leaves the tracker's own defaults alone)."""

PROJECT = "earl_megatron"
"""The project (wandb, trackio, swanlab) or experiment (mlflow) runs go to when the user's
environment names none; the run's name is its output directory's name."""


def check_installed(loggers: Iterable[str]) -> None:
    """ConfigError naming the extra for the first tracker whose package is not importable."""
    for name in loggers:
        for module in LOGGERS[name]:
            if importlib.util.find_spec(module) is None:
                raise ConfigError(f"run.loggers={name}: the {module} package is not "
                                  f"installed; pip install earl_megatron[{name}] (or drop "
                                  f"{name} from run.loggers)")


def configured_by_env(name: str) -> bool:
    """Whether the user's environment already points tracker ``name`` somewhere."""
    import os
    return any(os.environ.get(v) for v in ENV[name])


def flatten(rec: dict, prefix: str = "") -> dict[str, float]:
    """A metrics record as {key: float}: nested dicts joined with '/', booleans, strings and
    non-finite numbers skipped (metrics.jsonl keeps them)."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return out


def eval_metrics(result: dict) -> dict[str, float]:
    """An evaluation's result ({"<opponent>/<mode>": {metric: value}}) as the ``eval/`` series."""
    return flatten(result, "eval/")


def eval_step(when: str, history: list[dict], first: int = 0) -> int:
    """The step an evaluation is logged at: the iterations done when it ran ("start": ``first``,
    "iterN": N, "end": one past the last recorded iteration)."""
    if when.startswith("iter") and when[4:].isdigit():
        return int(when[4:])
    if when == "end" and history:
        return int(history[-1]["iteration"]) + 1
    return first


class Tracker:
    """One tracker's adapter (a module of this package per tracker)."""

    name = ""

    def __init__(self, out_dir: Path, run_name: str, start: int):
        self.out_dir, self.run_name, self.start_iteration = out_dir, run_name, start

    def start(self, config: dict) -> Optional[str]:
        """Open the run and log ``config`` once; a line saying where it writes (or None)."""
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_eval(self, metrics: dict[str, float], step: int) -> None:
        self.log(metrics, step)

    def finish(self) -> None:
        raise NotImplementedError


def make(name: str, out_dir: Path, run_name: str, start: int) -> Tracker:
    module = importlib.import_module(f"earl_megatron.trackers.to_{name}")
    return module.ADAPTER(out_dir, run_name, start)


class Trackers:
    """The run's trackers on rank 0 (module docstring): each call goes to every live tracker,
    and one that raises is reported once through ``say`` and dropped."""

    def __init__(self, loggers: Iterable[str], out_dir, start: int = 0, *, enabled: bool = True,
                 say: Callable[[str], None] = print):
        self.names = tuple(loggers) if enabled else ()
        self.out_dir, self.start_iteration, self.say = Path(out_dir), start, say
        self.live: list[Tracker] = []

    def _guard(self, tracker: Tracker, what: str, call) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - any failure of a tracker: it goes, the run stays
            self.say(f"{tracker.name}: {what} failed ({type(e).__name__}: "
                     f"{' '.join(str(e).split())[:300]}); tracker disabled, metrics.jsonl "
                     "has every value")
            if tracker in self.live:
                self.live.remove(tracker)
            if what != "finish":
                with contextlib.suppress(Exception):
                    tracker.finish()

    def start(self, config: dict) -> None:
        config = json.loads(json.dumps(config))   # as resolved.json holds it: lists, no tuples
        run_name = self.out_dir.resolve().name
        for name in self.names:
            try:
                tracker = make(name, self.out_dir, run_name, self.start_iteration)
            except Exception as e:  # noqa: BLE001 - an import that fails at runtime
                self.say(f"{name}: could not load ({type(e).__name__}: {e}); tracker disabled")
                continue
            self.live.append(tracker)
            where: list = []
            self._guard(tracker, "start", lambda t=tracker: where.append(t.start(config)))
            if tracker in self.live and where and where[0]:
                self.say(f"{name}: {where[0]}")

    def log(self, rec: dict) -> None:
        metrics, step = flatten({k: v for k, v in rec.items() if k != "iteration"}), \
            int(rec["iteration"])
        for t in list(self.live):
            self._guard(t, "log", lambda t=t: t.log(metrics, step))

    def log_eval(self, result: dict, step: int) -> None:
        metrics = eval_metrics(result)
        for t in list(self.live):
            self._guard(t, "log_eval", lambda t=t: t.log_eval(metrics, step))

    def finish(self) -> None:
        for t in list(self.live):
            self._guard(t, "finish", t.finish)
        self.live = []

    @contextlib.contextmanager
    def started(self, config: dict):
        self.start(config)
        try:
            yield self
        finally:
            self.finish()
