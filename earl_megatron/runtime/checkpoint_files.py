"""The checkpoint file protocol: how a checkpoint directory is published, found, judged and retired.

No torch, no Megatron: only files. runtime/checkpoint.py writes the contents (dist_checkpointing's
shards, loop.json, the model config) into ``iter_N.tmp`` and hands it to ``_publish``; the
trainer and the tools find what to load with ``find_checkpoint``. Publishing, on rank 0 after
every rank has written its shards (Megatron's writer fsyncs those)::

    iter_N.tmp/ written -> every file and the folder fsynced
    [iter_N exists: a re-save]  iter_N -> iter_N.old          (the old copy stays complete)
    iter_N.tmp -> iter_N; root fsynced
    latest.tmp (fsynced) -> latest; root fsynced
    iter_N.old removed; keep_last: older checkpoints renamed to *.del, then removed

Invariants (tests/unit/test_checkpoint_files.py):
- At every moment the root holds a complete checkpoint once it held one: nothing is deleted
  before its successor is complete on disk and ``latest`` names it (tested by failing each
  step of a re-save in turn).
- Complete means ``loop.json`` parses and dist_checkpointing's metadata files exist
  (``damage``). ``find_checkpoint`` returns the newest complete one (an ``iter_N.old`` left by a
  re-save killed mid-swap counts as iteration N) and one line per newer one it had to skip;
  when checkpoints exist but none is complete it raises a CheckpointError naming each file.
- Retention (``keep_last``) keeps the newest ``keep_last`` complete checkpoints up to the one
  just saved and deletes the published ones older than those, oldest first; damaged ones
  between them and checkpoints newer than the one just saved are left alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from earl_megatron.runtime.io_errors import CheckpointError

REQUIRED = ("metadata.json", ".metadata")
"""What dist_checkpointing's torch_dist save writes last per checkpoint, besides the shards."""
_NAME = re.compile(r"^iter_(\d+)(\.old)?$")


def checkpoint_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:06d}"


# ------------------------------------------------------------------ finding one to resume
def read_loop_state(path: str | Path) -> dict[str, Any]:
    """``<path>/loop.json`` as a dict; a missing, truncated or non-JSON file is a CheckpointError
    naming it."""
    f = Path(path) / "loop.json"
    try:
        state = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: {path} is an incomplete checkpoint (an "
                              "interrupted save or a partial copy)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is truncated or not JSON ({str(e).splitlines()[0]})") \
            from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f} holds a {type(state).__name__}, not the loop state")
    return state


def damage(path: str | Path) -> Optional[str]:
    """None when ``path`` is a complete checkpoint; else what is wrong, naming the file."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} does not exist"
    try:
        read_loop_state(path)
    except CheckpointError as e:
        return str(e)
    for name in REQUIRED:
        if not (path / name).is_file():
            return f"{path / name} is missing (an interrupted or partial copy)"
    return None


def _published(root: Path) -> list[tuple[int, bool, Path]]:
    """(iteration, is a live iter_N rather than an iter_N.old, path), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), m.group(2) is None, p))
    return sorted(found)


@dataclasses.dataclass(frozen=True)
class Found:
    """The checkpoint to resume from: its path, its loop state, and one line per newer
    checkpoint that was skipped because it is damaged (empty when the newest is complete)."""

    path: Path
    state: dict
    skipped: tuple[str, ...] = ()

    def message(self) -> Optional[str]:
        if not self.skipped:
            return None
        return (f"resuming from {self.path}, the newest complete checkpoint; skipped "
                + "; ".join(self.skipped))


def find_checkpoint(root: str | Path) -> Optional[Found]:
    """The newest complete checkpoint under ``root`` (None: none was ever published there)."""
    root = Path(root)
    skipped = []
    marker = root / "latest"
    if marker.exists():
        named = root / marker.read_text().strip()
        if not named.is_dir():
            skipped.append(f"{marker} names {named}, which does not exist")
    for _, _, path in reversed(_published(root)):
        why = damage(path)
        if why is None:
            return Found(path, read_loop_state(path), tuple(skipped))
        skipped.append(why)
    if skipped:
        raise CheckpointError(f"no complete checkpoint under {root}: {'; '.join(skipped)}. Copy "
                              f"the checkpoint back, or delete {root} (or choose a new "
                              "run.output_dir) to start over")
    return None


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The newest complete checkpoint's directory (``find_checkpoint``), or None."""
    found = find_checkpoint(root)
    return found.path if found is not None else None


# ------------------------------------------------------------------ saving
def retention(published: list[tuple[int, bool]], newest: int, keep_last: Optional[int]
              ) -> list[int]:
    """Pure: the indices into ``published`` ((iteration, complete), oldest first) to delete,
    oldest first, after ``newest`` was saved (complete). None keeps everything."""
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (None keeps every checkpoint)")
    upto = [i for i, (it, _) in enumerate(published) if it <= newest]
    kept = [i for i in upto if published[i][1]][-keep_last:]
    if not kept:
        return []
    return [i for i in upto if published[i][0] < published[kept[0]][0]]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(top: Path) -> None:
    """Every file under ``top``, then every folder bottom-up (a file's name lives in its folder)."""
    for folder, _, files in os.walk(top, topdown=False):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def _remove(path: Path) -> None:
    """Rename out of the checkpoint namespace first (atomic), then delete: a removal killed
    half way never leaves a partial iter_N that looks like a checkpoint."""
    gone = path.with_name(path.name + ".del")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _publish(tmp: Path, final: Path, keep_last: Optional[int], iteration: int) -> None:
    root = final.parent
    _fsync_tree(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():  # a re-save: keep the old copy, complete, until the new one is named
        shutil.rmtree(old, ignore_errors=True)  # a finished swap's leftover (final is newer)
        os.replace(final, old)
        _fsync(root)
    os.replace(tmp, final)
    _fsync(root)
    _write_synced(root / "latest.tmp", final.name)
    os.replace(root / "latest.tmp", root / "latest")
    _fsync(root)
    if old.exists():
        _remove(old)
    # leftovers of killed saves and removals; then retention, oldest first
    for p in root.iterdir():
        if p.is_dir() and (p.name.endswith(".del") or
                           (p.name.endswith(".tmp") and p.name.startswith("iter_"))):
            shutil.rmtree(p, ignore_errors=True)
    pub = _published(root)
    # an iter_N.old beside a live iter_N is a finished swap's leftover
    live = {it for it, is_live, _ in pub if is_live}
    for it, is_live, p in pub:
        if not is_live and it in live:
            _remove(p)
    pub = _published(root)
    for i in retention([(it, damage(p) is None) for it, _, p in pub], iteration, keep_last):
        _remove(pub[i][2])
