"""Stopping at a safe point when told to (Slurm preemption, scancel, a time limit's signal).

Two ways to be told, both per rank and both cheap to poll:
- SIGTERM to the worker (torchrun forwards its own TERM to its workers; Slurm sends one to the
  job step when ``--signal`` has no ``B:``);
- the run's stop file, ``<run.output_dir>/stop`` (``$EARL_STOP_FILE`` overrides the path): a
  file whose text starts with ``requested``. recipes/slurm/train.sbatch traps TERM in the batch
  shell and writes it there, so torchrun itself is never signalled and exits 0; by hand,
  ``echo requested > <run>/stop`` does the same. It lives in the run directory, beside the
  checkpoints it protects: only who may write the run may stop it (never the submit directory,
  which a whole group may share). A ``requested`` left behind by a run that died before reading
  it stops the next run at its first safe point (the sbatch script clears it at each start).
When the trainer has stopped cleanly (its last completed iteration checkpointed) rank 0 writes
``stopped <iteration>`` to the same file; the batch script reads it to requeue the job. A run
that was not told to stop never writes the file.

Agreement (ranks see a signal or a file at different moments; a collective must never be
skipped by some ranks only):
- ``replica_should_stop()``: inside the rollout, at each turn, all ranks of ONE rollout replica
  (its tp x pp ranks, which decode in lockstep) agree; a replica that agrees abandons its
  episodes at once (rollout.agent_loop.RolloutAbandoned). Replicas never wait for each other.
- ``world_should_stop()``: at a stage boundary, every rank of the world agrees (an all-reduce
  MAX). Once true it stays true.

Invariant: an iteration is either completed (trained, recorded, checkpointable) or abandoned
before its first optimizer step; the trainer never records half an iteration. Policy: the
rollout (and an evaluation) is abandoned at the next turn; a train stage that has begun is
finished, then the iteration is recorded and checkpointed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

STOP_FILE_ENV = "EARL_STOP_FILE"
STOP_FILE_NAME = "stop"
"""The stop file's name in the run directory when ``$EARL_STOP_FILE`` does not say otherwise."""


def stop_file_for(output_dir: str | os.PathLike) -> Path:
    """The stop file of the run in ``output_dir``: ``$EARL_STOP_FILE``, else ``<output_dir>/stop``
    (what recipes/slurm/train.sbatch writes to)."""
    return Path(os.environ.get(STOP_FILE_ENV) or Path(output_dir) / STOP_FILE_NAME)


_INSTALLED: Optional["StopControl"] = None


def told_to_stop() -> bool:
    """Whether this process has been told to stop (a SIGTERM since ``install()``, or a
    ``requested`` stop file); False when no control is installed. No collective. For code that
    must wait on the request itself: earl_megatron/testing/envs.py's held environment."""
    return _INSTALLED is not None and _INSTALLED.local()


class StopControl:
    """One per trainer process; ``install()`` once before training, ``close()`` after."""

    def __init__(self, stop_file: Optional[str | os.PathLike] = None):
        self.stop_file = Path(stop_file) if stop_file else None
        self._signalled = False
        self._agreed = False
        self._previous = None

    @classmethod
    def for_run(cls, output_dir: str | os.PathLike) -> "StopControl":
        """The control of the run in ``output_dir`` (its stop file: ``stop_file_for``)."""
        return cls(stop_file_for(output_dir))

    def install(self) -> "StopControl":
        global _INSTALLED
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        _INSTALLED = self
        return self

    def close(self) -> None:
        global _INSTALLED
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if _INSTALLED is self:
            _INSTALLED = None

    def _on_sigterm(self, signum, frame) -> None:
        self._signalled = True  # acted on at the next safe point

    @property
    def stopping(self) -> bool:
        """True once the world agreed to stop (no collective)."""
        return self._agreed

    def local(self) -> bool:
        """This rank was told to stop (signal or stop file); no collective."""
        if self._signalled or self._agreed:
            return True
        if self.stop_file is not None:
            try:
                return self.stop_file.read_text().startswith("requested")
            except OSError:
                return False
        return False

    def world_should_stop(self) -> bool:
        """Collective over the world: does any rank want to stop?"""
        flag = torch.tensor([int(self.local())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._agreed = self._agreed or bool(flag.item())
        return self._agreed

    def pool_should_stop(self) -> bool:
        """Collective over this rank's pool (runtime/groups.py ``pool_group``): the world
        under colocated placement, the train or the rollout pool under split placement, whose
        pools agree with each other only where they meet (trainer/split.py)."""
        from earl_megatron.runtime import groups

        flag = torch.tensor([int(self.local())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups.pool_group())
        self._agreed = self._agreed or bool(flag.item())
        return self._agreed

    def agree(self, stop: bool) -> bool:
        """Record a decision the ranks reached together some other way (split placement's
        meeting); once stopping, always stopping."""
        self._agreed = self._agreed or stop
        return self._agreed

    def replica_should_stop(self) -> bool:
        """Collective over this rank's rollout replica (tp then pp groups of the live layout)."""
        from earl_megatron.runtime import groups

        flag = torch.tensor([int(self.local())])
        for group in (groups.tp_group(), groups.pp_group()):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def mark_stopped(self, last_completed: int) -> None:
        """Rank 0, after the final checkpoint: tell the batch script the stop was clean."""
        if self.stop_file is None or dist.get_rank() != 0:
            return
        tmp = self.stop_file.with_name(self.stop_file.name + ".tmp")
        tmp.write_text(f"stopped {last_completed}\n")
        os.replace(tmp, self.stop_file)
