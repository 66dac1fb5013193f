"""Environments registered by name, so configs say ``env: connect_four`` and never import classes.

``make_env(name, **kwargs)`` builds a fresh environment; an unknown name raises a KeyError that
lists the known names. Registration happens in ``earl_megatron.envs`` (its ``__init__``) for the
built-in environments; ``register_env`` adds others. A name can be registered once.
"""

from __future__ import annotations

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
    _ensure_builtins()
    return tuple(sorted(_FACTORIES))


def make_env(name: str, **kwargs) -> Env:
    """A new environment ``name`` built with ``kwargs`` (see each class for its options)."""
    _ensure_builtins()
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise UnknownEnvError(f"unknown environment {name!r}; known environments: "
                              f"{', '.join(sorted(_FACTORIES))}") from None
    return factory(**kwargs)


def _ensure_builtins() -> None:
    # Importing the package registers the built-in environments; done lazily so that importing
    # this module alone has no side effects beyond the (empty) table.
    import earl_megatron.envs  # noqa: F401
