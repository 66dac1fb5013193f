"""Range checks every configuration section shares, and the error they raise.

``ConfigError`` lives here, not in config/train.py, so that the sections train.py imports
(config/model.py, config/sft.py, config/rollout.py, config/algorithm.py) raise it too: every
bad value is one ``ConfigError`` whose message names the key (``section.field=value``) and what
to use instead. Invariants:

- ``require_finite`` rejects nan and +-inf in every float field of a section and of its nested
  sections (a nan learning rate passes ``lr <= 0``; comparisons cannot catch it, this does);
  ``TrainConfig.from_dict`` applies the same ``check_finite`` to each float as it is read, so
  the message is the same whichever section check would have seen the value first.
- ``at_least`` is the count check: a field left None ("not set") passes, any other value below
  the bound is an error. A check that divides by a field runs after its ``at_least``.
Pure Python: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math


class ConfigError(ValueError):
    """A configuration value the run cannot use; the message names the key and the fix."""


def at_least(section, name: str, low: int, *fields: str) -> None:
    """Range check of integer fields of ``section`` (None passes: "not set")."""
    for f in fields:
        v = getattr(section, f)
        if v is not None and v < low:
            raise ConfigError(f"{name}.{f}={v} must be >= {low}")


def check_finite(key: str, value) -> None:
    """``value`` (of the config key ``key``) is not a nan or infinite float."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number")


def require_finite(section, name: str) -> None:
    """Every float field of the dataclass ``section`` (and of its nested dataclasses) finite."""
    for f in dataclasses.fields(section):
        key, v = (f"{name}.{f.name}" if name else f.name), getattr(section, f.name)
        if dataclasses.is_dataclass(v):
            require_finite(v, key)
        else:
            check_finite(key, v)
