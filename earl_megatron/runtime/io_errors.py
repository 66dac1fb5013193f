"""Checkpoint-reading errors and output folders, for the conversion tools, load_policy and resume
(runtime/checkpoint.py); the weights/ layer above uses them too.

Every failure a user can cause or meet (a truncated or corrupt file, a missing file, an output
folder that is not empty, is the input itself, or cannot be written) surfaces as ONE line that
names the problem and the fix: a ``CheckpointError`` (a ValueError), which the tools print as
``error: ...`` with exit status 2 (``run_tool``).

Invariants:
- ``reading(path)`` turns whatever torch's distributed checkpoint, Megatron's dist_checkpointing,
  pickle or safetensors raise on damaged input into a CheckpointError. torch's
  ``CheckpointException`` derives from BaseException (``except Exception`` misses it): it is
  caught by name, and KeyboardInterrupt/SystemExit pass through untouched.
- ``new_output_dir(out, inputs)`` accepts only a folder that does not exist or is empty, is none
  of the inputs and neither contains nor lies inside one; on any exception inside it, everything
  it created is removed (no ``part-*.safetensors.tmp``, no half-merged checkpoint). A file the
  tool did not write is never overwritten, because the folder held none.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

__all__ = ["CheckpointError", "reading", "new_output_dir", "run_tool", "first_line"]



class CheckpointError(ValueError):
    """A checkpoint (training, converted or Hugging Face) that is incomplete, corrupt or does not
    load, or an output folder a tool must not write: the message names the problem and the fix."""


RECOPY = "copy the checkpoint again, or write it anew (convert or save again)"


def first_line(exc: BaseException) -> str:
    """The innermost cause's first line (a CheckpointException's first failing rank's)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))[0]
        return first_line(inner)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _damaged_types() -> tuple[type[BaseException], ...]:
    from torch.distributed.checkpoint.api import CheckpointException

    kinds: list[type[BaseException]] = [CheckpointException, pickle.UnpicklingError, EOFError]
    with contextlib.suppress(ImportError):
        from megatron.core.dist_checkpointing.core import CheckpointingException
        kinds.append(CheckpointingException)
    with contextlib.suppress(ImportError):
        from safetensors import SafetensorError
        kinds.append(SafetensorError)
    return tuple(kinds)


@contextlib.contextmanager
def reading(path: str | os.PathLike, what: str = "checkpoint") -> Iterator[None]:
    """Translate errors while reading ``path`` into one-line CheckpointErrors."""
    try:
        yield
    except CheckpointError:
        raise
    except FileNotFoundError as e:
        missing = e.filename or first_line(e)
        raise CheckpointError(f"{what} {path} is incomplete: {missing} is missing; "
                              f"{RECOPY}") from None
    except _damaged_types() as e:
        cause = first_line(e)
        if "FileNotFoundError" in cause:
            raise CheckpointError(f"{what} {path} is incomplete ({cause}); {RECOPY}") from None
        raise CheckpointError(f"{what} {path} is truncated or corrupt ({cause}); "
                              f"{RECOPY}") from None


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


@contextlib.contextmanager
def new_output_dir(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()
                   ) -> Iterator[Path]:
    """Check, create and yield ``out``; on an exception remove what was created, re-raise."""
    path = Path(out)
    real = path.resolve()
    for src in inputs:
        s = Path(src).resolve()
        if _inside(real, s) or _inside(s, real):
            raise CheckpointError(f"output folder {path} is (or is inside, or contains) the input "
                                  f"{src}; choose an output folder outside it")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"output {path} exists and is not a folder; choose a new folder")
    if path.is_dir() and any(path.iterdir()):
        held = sorted(p.name for p in path.iterdir())
        raise CheckpointError(f"output folder {path} is not empty (holds {held[:3]}); choose a "
                              "new or empty folder: files this tool did not write are never "
                              "overwritten")
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        if created:
            shutil.rmtree(path, ignore_errors=True)
        raise CheckpointError(f"cannot write the output folder {path} ({first_line(e)}); choose "
                              "a writable location") from None
    try:
        yield path
    except BaseException:
        if created:
            shutil.rmtree(path, ignore_errors=True)
        else:  # it was empty: everything in it is ours
            for p in path.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        raise


def run_tool(fn: Callable[[], int]) -> int:
    """A tool's main body; a CheckpointError (or a ValueError/KeyError/OSError naming bad input)
    becomes ``error: <one line>`` on stderr and exit status 2."""
    try:
        return fn()
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {' '.join(str(text).split())}", file=sys.stderr)
        return 2
