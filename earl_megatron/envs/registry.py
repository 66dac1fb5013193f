"""Environments registered by name, so configs say ``env: connect_four`` and never import classes.

``make_env(name, **kwargs)`` builds a fresh environment; an unknown name raises a KeyError that
lists the known names. Registration happens in ``earl_megatron.envs`` (its ``__init__``) for the
built-in environments; ``register_env`` adds others. A name can be registered once.

A name of the form ``package.module:factory`` names an environment outside the registry: the
module is imported and ``factory(**kwargs)`` builds it, in every process that asks (so a config
can use an environment of another package under torchrun without editing this one; the
tests' held environment is ``earl_megatron.testing.envs:held_connect_four``).
"""

from __future__ import annotations

import importlib
from typing import Callable

from earl_megatron.envs.base import Env

_FACTORIES: dict[str, Callable[..., Env]] = {}


class UnknownEnvError(KeyError):
    def __str__(self) -> str:  # KeyError's default str() wraps the message in quotes
        return str(self.args[0])


def register_env(name: str, factory: Callable[..., Env]) -> None:
    if name in _FACTORIES and _FACTORIES[name] is not factory:
        raise ValueError(f"environment {name!r} is already registered to {_FACTORIES[name]!r}; "
                         "pick another name")
    _FACTORIES[name] = factory


def list_envs() -> tuple[str, ...]:
    """The registered names (``module:factory`` names are not listed: any importable one works)."""
    _ensure_builtins()
    return tuple(sorted(_FACTORIES))


def env_factory(name: str) -> Callable[..., Env]:
    """The factory ``name`` stands for: a registered name, or ``package.module:factory``.
    Raises UnknownEnvError naming what is missing and what is known."""
    _ensure_builtins()
    if name in _FACTORIES:
        return _FACTORIES[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise UnknownEnvError(f"environment {name!r}: cannot import {module!r} ({e}); name a "
                                  "registered environment or an importable module:factory"
                                  ) from None
        except AttributeError:
            raise UnknownEnvError(f"environment {name!r}: module {module!r} has no {attr!r}; "
                                  "name a callable that returns an Env") from None
        if not callable(factory):
            raise UnknownEnvError(f"environment {name!r}: {attr!r} is not callable")
        return factory
    raise UnknownEnvError(f"unknown environment {name!r}; known environments: "
                          f"{', '.join(sorted(_FACTORIES))} (or package.module:factory)")


def make_env(name: str, **kwargs) -> Env:
    """A new environment ``name`` built with ``kwargs`` (see each class for its options)."""
    return env_factory(name)(**kwargs)


def _ensure_builtins() -> None:
    # Importing the package registers the built-in environments; done lazily so that importing
    # this module alone has no side effects beyond the (empty) table.
    import earl_megatron.envs  # noqa: F401
