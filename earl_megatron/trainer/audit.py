"""The run's audit (tests only): what each rank played and handed over, trained and held.

With ``EARL_SPLIT_AUDIT`` set to a directory, every rank appends rows to ``rank<r>.jsonl`` there,
read back by tests/distributed/split_audit.py: ``sent`` (a rollout replica leader's batch: pool
keys, episode digests, dropped), ``train`` (a train stage; its replica leader's rows carry the
digests it trained), ``rollout`` (a stage's start and end), ``weights`` (each pool's weights
hashed after a handoff, or, SGLang, the policy's and its servers' after auto moved into colocated
placement; costs a weight gather each) and ``stopped`` (the server processes a move stopped,
and any of them still there). Both placements write it, so a run that auto moves between them
is checked exactly once across the moves. Under colocated placement the batch a replica plays is
the batch trained (score_and_train dispatches it whole), so its leader writes both rows for its
block.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from earl_megatron.runtime import groups

AUDIT_ENV = "EARL_SPLIT_AUDIT"
"""A directory: every rank appends what it sent, trained and held to ``rank<r>.jsonl`` there."""


class RunAudit:
    """What each rank sent, trained and held, appended to ``<dir>/rank<r>.jsonl`` (tests)."""

    def __init__(self, rank: int, directory: Optional[Path]):
        self.rank, self.dir = rank, directory

    @classmethod
    def from_env(cls, rank: int) -> "RunAudit":
        return cls(rank, Path(os.environ[AUDIT_ENV]) if os.environ.get(AUDIT_ENV) else None)

    def _write(self, row: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def stage(self, model, side: str, it: int, t0: float, *, ids=(), episodes=()) -> None:
        """A stage's start and end; a train stage on ``model``'s replica leader: the digests
        of the episodes it trained."""
        if self.dir is None:
            return
        row = {"side": side, "it": it, "start": t0 + time.time() - time.perf_counter(),
               "end": time.time()}
        if side == "train" and model.coords.tp == 0 and model.coords.pp == 0:
            row["digests"] = sorted(_digest(e) for e in episodes)
            row["ids"] = list(ids)
            row["rewards"] = [float(e.reward) for e in episodes]   # beside ids
        self._write(row)

    def sent(self, pool, j: int, out) -> None:
        """A rollout replica leader's block of batch ``j`` (``out``, the episode pool's)."""
        if self.dir is None or out is None or not pool.leader:
            return
        self._write({"side": "sent", "it": j, "keys": [list(k) for k in out.keys],
                     "digests": sorted(_digest(e) for e in out.episodes),
                     "dropped": out.metrics.get("pool_dropped", 0)})

    def weights(self, split, j: int) -> None:
        """Each pool's full weights, gathered inside the pool, hashed by its first rank. With
        SGLang the train pool hashes them under HF names and each server's leader hashes what
        its server holds, read back by name (/get_weights_by_name), as float32."""
        if self.dir is None:
            return
        from earl_megatron.weights.gather import gather_full
        from earl_megatron.weights.hf_mapping import to_hf

        if split.sglang and not split.train_side:
            self._held(split.tr.rollout, j)
            return
        model = split.model
        full = gather_full(model.model, model.cfg, model.layout)
        if groups.pool_rank() == 0:
            if split.sglang:
                full = {name: t.float() for name, t in to_hf(split.tr.cfg.model, full).items()}
            self._write({"side": "weights", "it": j,
                         "pool": "train" if split.train_side else "rollout",
                         "sha256": _weights_digest(full), "names": len(full)})


    def _held(self, rollout, j: int) -> None:
        """A server leader: what its server holds, read back by name, hashed as float32 (whole
        tensors on tp1 servers only: SGLang's /get_weights_by_name on a tp > 1 server answers
        with its tp rank 0's shard of the column-parallel weights (q/k/v, gate/up, the
        embedding) and gathers only the row-parallel ones, sglang/srt/models/llama.py)."""
        engine = rollout.engine
        if engine is not None:
            held = {name: torch.tensor(engine.weights_by_name(name, t.shape[0]),
                                       dtype=torch.float32)
                    for bucket in rollout.last_push for name, t in bucket}
            self._write({"side": "weights", "it": j, "pool": "rollout",
                         "sha256": _weights_digest(held), "names": len(held)})

    def served(self, rollout, policy, j: int) -> None:
        """auto moved into colocated placement before stage ``j`` (SGLang): the policy's
        weights under HF names (rank 0) and what each server holds (its leader), as
        ``weights`` rows; collective over the world."""
        if self.dir is None:
            return
        from earl_megatron.weights.gather import gather_full
        from earl_megatron.weights.hf_mapping import to_hf

        full = gather_full(policy.model, policy.cfg, policy.layout)
        if self.rank == 0:
            hf = {name: t.float() for name, t in to_hf(policy.cfg, full).items()}
            self._write({"side": "weights", "it": j, "pool": "train",
                         "sha256": _weights_digest(hf), "names": len(hf)})
        self._held(rollout, j)

    def stopped(self, j: int, pids: list) -> None:
        """auto moved before stage ``j``: the server processes this rank stopped, and those of
        them still there 30 s later (rollout/sglang_server.py ``process_group_gone``)."""
        if self.dir is None:
            return
        from earl_megatron.rollout.sglang_server import process_group_gone

        self._write({"side": "stopped", "it": j, "pids": list(pids),
                     "alive": [p for p in pids if not process_group_gone(p)]})


def _weights_digest(named: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _digest(e) -> str:
    """An episode's identity for the audit: its tokens, mask, logprobs and versions."""
    return hashlib.sha256(repr((e.token_ids, e.loss_mask, e.logprobs, e.versions))
                          .encode()).hexdigest()[:20]
