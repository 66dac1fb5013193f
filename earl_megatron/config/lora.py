"""The ``model.lora`` section: low-rank adapters on the policy's linears (issue #46). Pure Python.

``LoraSpec`` is both the config section and what ``models/lora.py apply_lora`` takes: ``rank``
0 (the default) is off, the run trains every parameter as before; ``rank`` r >= 1 wraps every
linear named in ``targets`` with A [r, in] and B [out, r] and freezes the base
(docs/lora.md). Every bad value is one ``ConfigError`` naming ``model.lora.<key>`` and the fix,
whether or not the rank turns LoRA on (a typo in a disabled section is still a typo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from earl_megatron.config.checks import ConfigError

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linears of a transformer layer an adapter can target (Megatron-Core's names)."""


def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how: ``rank`` r of A [r, in] and B [out, r] (0: LoRA off); the update
    is scaled by ``alpha / rank``; ``dropout`` on the adapter's input only (0 turns it off);
    ``targets`` a non-empty subset of ``TARGETS``."""

    rank: int = 0
    """Adapter rank; 0: no adapters, every parameter trains."""
    alpha: float = 16.0
    """The update B A x is scaled by alpha / rank (often 2 x rank)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only); 0: off."""
    targets: tuple[str, ...] = TARGETS
    """Which linears of every layer get an adapter: any of ``TARGETS``."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"model.lora.rank={self.rank!r}: use a positive integer (e.g. 8 "
                              "or 16), or 0 to train without adapters")
        if not _number(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha={self.alpha!r}: use a positive number (often "
                              "2 x rank)")
        if not _number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout={self.dropout!r}: use a probability in "
                              "[0, 1)")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise ConfigError(f"model.lora.targets: {unknown} unknown; use any of "
                              f"{list(TARGETS)}")
        if not targets:
            raise ConfigError(f"model.lora.targets is empty: name at least one of "
                              f"{list(TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ConfigError(f"model.lora.targets={list(targets)} repeats a name: list each "
                              "once")
        object.__setattr__(self, "targets", targets)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0
