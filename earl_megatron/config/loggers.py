"""The trackers run.loggers may name, and the check of the list (pure: no tracker imported).

The adapters live in earl_megatron/trackers (a higher layer); the configuration only needs the
names, so an unknown or repeated one is a ConfigError when the configuration is built.
"""

from __future__ import annotations

from typing import Iterable

from earl_megatron.config.checks import ConfigError

LOGGERS = {"tensorboard": ("tensorboard",), "wandb": ("wandb",),
           "mlflow": ("mlflow", "sqlalchemy", "alembic"), "trackio": ("trackio",),
           "swanlab": ("swanlab",)}
"""run.loggers name -> the modules its extra installs (the extra is named as the logger;
MLflow's SQLite store, its offline default, needs SQLAlchemy and alembic)."""

def check_names(loggers: Iterable[str]) -> None:
    """ConfigError for an unknown or repeated name (config/train.py RunConfig)."""
    seen = set()
    for name in loggers:
        if name not in LOGGERS:
            raise ConfigError(f"run.loggers: unknown tracker {name!r}; choose from "
                              f"{list(LOGGERS)}, e.g. run.loggers=[tensorboard,wandb]")
        if name in seen:
            raise ConfigError(f"run.loggers lists {name!r} twice: list each tracker once")
        seen.add(name)
