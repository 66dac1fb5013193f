"""Who calls a function during a block (tests): ``with callers(module, "name") as seen:``.

``seen`` fills with the name of the calling function of each call of ``module.name`` made
inside the block (callers that look the name up on the module at call time, as function-local
imports do); the function is restored after it.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator


@contextlib.contextmanager
def callers(module, name: str) -> Iterator[list[str]]:
    seen: list[str] = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        seen.append(inspect.currentframe().f_back.f_code.co_name)
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield seen
    finally:
        setattr(module, name, original)
