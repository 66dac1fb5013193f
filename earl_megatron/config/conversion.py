"""Plain containers -> configuration dataclasses, and a checkpoint's model merged with the user's keys.

``build(cls, d, path)`` turns a plain dict (Hydra's composed config, as a container) into the
frozen dataclass ``cls``, recursively: unknown keys, wrong types and non-finite floats are a
``ConfigError`` naming the key (``section.field``), before the dataclass's own checks run.
``init_model`` is the same for ``run.init``: the checkpoint's ModelConfig with the model keys the
user set, checked against it. Pure Python: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from earl_megatron.config.checks import ConfigError, check_finite
from earl_megatron.config.model import INIT_MAY_DIFFER, ModelConfig


def init_model(found: ModelConfig, overrides: dict, init: str) -> ModelConfig:
    """The model of a run that starts from the checkpoint ``init``, whose config is ``found``,
    with ``overrides`` ({field: value} the user set, as composed): a field equal to the
    checkpoint's (floats within a relative 1e-6, None-defaults resolved as ModelConfig resolves
    them) keeps the checkpoint's exact value; a field of ``INIT_MAY_DIFFER`` and the ``lora``
    section take the value given; any other difference is a ConfigError naming the field, both
    values and the fix."""
    hints, keys = typing.get_type_hints(ModelConfig), config_keys(ModelConfig)
    overrides = without_internal(ModelConfig, overrides, "model")
    unknown = sorted(set(overrides) - keys)
    if unknown:
        raise ConfigError(f"unknown key(s) {[f'model.{k}' for k in unknown]}; valid keys of "
                          f"model: {sorted(keys)}")
    changes = {}
    for name, raw in overrides.items():
        want, have = coerce(hints[name], raw, f"model.{name}"), getattr(found, name)
        if isinstance(want, float) and isinstance(have, float) and \
                math.isclose(want, have, rel_tol=1e-6):
            continue
        # model.lora: the adapters this run trains over the checkpoint's weights (fresh, they
        # change nothing at first), the run's choice and never the checkpoint's
        if name in INIT_MAY_DIFFER or name == "lora":
            changes[name] = want
            continue
        try:  # as ModelConfig normalises it (kv_channels=head_dim -> None, None -> the family's)
            same = found.with_(**{name: want}) == found
        except (ConfigError, TypeError, ValueError):
            same = False
        if not same:
            raise ConfigError(
                f"model.{name}={want} does not match run.init={init}, whose model has {name}="
                f"{have}: drop model.{name} to take the checkpoint's value, or point run.init "
                f"at a checkpoint with {name}={want} (only {', '.join(INIT_MAY_DIFFER)} may "
                "differ from it)")
    return found.with_(**changes)  # a bad value of a field that may differ: its ConfigError


REPLACED = {
    "algorithm.tis_cap": "use algorithm.off_policy=tis algorithm.off_policy_cap=<cap> (with "
                         "algorithm.old_logprobs=recompute), or off_policy=decoupled",
    "run.tensorboard": "use run.loggers=[tensorboard] (with any of wandb, mlflow, trackio, "
                       "swanlab beside it)",
}
"""Keys an earlier version read, and what says the same now."""


def config_keys(cls) -> set[str]:
    """The dataclass ``cls``'s fields a config sets: all but those marked ``internal`` in their
    metadata (set by the code, e.g. ModelConfig.value_head, a critic's)."""
    return {f.name for f in dataclasses.fields(cls) if "internal" not in f.metadata}


def without_internal(cls, d: dict, path: str) -> dict:
    """``d`` without ``cls``'s internal fields, each of which it may hold at its default only
    (a resolved.json writes them), else one ConfigError naming the key and why."""
    internal = [f for f in dataclasses.fields(cls) if "internal" in f.metadata]
    for f in internal:
        if f.name in d and d[f.name] != f.default:
            raise ConfigError(f"{_join(path, f.name)}={d[f.name]!r} is not a config key: "
                              f"{f.metadata['internal']}")
    return {k: v for k, v in d.items() if k not in {f.name for f in internal}}


def build(cls, d: Any, path: str):
    """The dataclass ``cls`` from the mapping ``d`` found at ``path`` (module docstring)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    names = config_keys(cls)
    d = without_internal(cls, d, path)
    unknown = sorted(set(d) - names)
    for k in unknown:
        if _join(path, k) in REPLACED:
            raise ConfigError(f"{_join(path, k)} was replaced: {REPLACED[_join(path, k)]}")
    if unknown:
        raise ConfigError(f"unknown key(s) {[_join(path, k) for k in unknown]}; valid keys of "
                          f"{path or 'the config'}: {sorted(names)}")
    kwargs = {}
    for name, value in d.items():
        kwargs[name] = coerce(hints[name], value, _join(path, name))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or 'config'}: {e}") from e


def coerce(tp, value, path):
    """``value`` as the type ``tp`` of the key at ``path`` (nested dataclasses built)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return coerce(args[0], value, path)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float:
        check_finite(path, value)
    if tp is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        return tuple(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return dict(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{path}={value!r} must be {tp.__name__}")
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{path}={value!r} must be int")
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
