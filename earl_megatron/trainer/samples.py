"""Episodes a person can read: each iteration rank 0 writes a few of them decoded to the run.

    <output_dir>/samples/iter_000003.jsonl        one JSON object per line, one line per sample:
    {"iteration": 3, "sample": 17, "env": "calculator", "seed": 2041, "reward": -1.0,
     "turn_rewards": [-1.0], "finish_reason": "done", "turns": 1, "tokens": 118,
     "policy_tokens": 24, "info": {"unparsable": true, "tool_calls": 0, ...},
     "actions": ["17*23 = 381."],
     "text": "<|im_start|>system\\n...<|im_start|>assistant\\n17*23 = 381.<|im_end|>",
     "turn_versions": [3],
     "segments": [{"trained": false, "text": "<|im_start|>system\\n...assistant\\n"},
                  {"trained": true, "text": "17*23 = 381.<|im_end|>", "version": 3}, ...]}

``text`` is the episode's whole token sequence decoded with special tokens kept: the
conversation exactly as the model saw it (the chat template's tokens, the environment's and
the tools' output, the sampled turns). ``segments`` cut it where the loss mask changes:
``trained`` true is what the policy sampled (and trains on), false is the prompt, the
template's tokens between turns and what the environment or a tool answered. ``actions`` are
the sampled turns as the environment received them (decoded without special tokens), so a
reward of "unparsable" can be read against what was parsed. ``turn_versions`` (and each
trained segment's ``version``) name the policy version that sampled each turn: the iteration
itself in the synchronous loop, older ones for an episode carried across iterations by
asynchronous RL (docs/async.md).

Which samples: those rank 0's rollout replica played (every rank of a replica holds the same
episodes, so no collective runs), ``per_iteration`` of them evenly spaced over its sample ids
(GRPO's groups are consecutive ids: spacing shows several prompts). Only they are decoded; the
other episodes' tokens are never touched. With ``all_replicas`` (run.samples_all_replicas)
every replica's leader writes ``per_iteration`` of its own block to its own file,

    <output_dir>/samples/iter_000003.r1.jsonl     replica 1's samples of iteration 3

each leader alone, with no collective (the replicas hold disjoint blocks: each sample is in one
file); the viewer (earl_megatron/viewer/rundir.py) reads both names.

Invariants: one file per iteration (per replica with ``all_replicas``), written whole
(temporary name, then renamed), so an iteration replayed after a resume replaces its file and
no sample appears twice; the writer of the plain file (or of replica 0's) also deletes the
iteration's files the other naming or a replica the layout no longer has left (a resume with
another setting or fewer replicas); ``per_iteration`` = 0 writes nothing and creates no folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

from earl_megatron.rollout.agent_loop import Episode

SAMPLES_DIR = "samples"


def pick(ids: Sequence[int], n: int) -> list[int]:
    """Up to ``n`` of ``ids``, evenly spaced over them in sorted order (all when fewer)."""
    ordered = sorted(ids)
    if n <= 0 or not ordered:
        return []
    if n >= len(ordered):
        return ordered
    return [ordered[i * len(ordered) // n] for i in range(n)]


def segments(token_ids: Sequence[int], loss_mask: Sequence[int]) -> list[tuple[bool, list[int]]]:
    """(trained, ids) for each maximal run of equal loss mask, in order."""
    out: list[tuple[bool, list[int]]] = []
    for t, m in zip(token_ids, loss_mask, strict=True):
        if out and out[-1][0] == bool(m):
            out[-1][1].append(t)
        else:
            out.append((bool(m), [t]))
    return out


def decode_sample(it: int, sample: int, e: Episode, tokenizer) -> dict:
    """One episode as the JSON object the samples file holds (see the module docstring)."""
    def dec(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    cut, at = [], 0
    for trained, ids in segments(e.token_ids, e.loss_mask):
        seg = {"trained": trained, "text": dec(ids)}
        if trained:   # the version of the weights that sampled this turn
            seg["version"] = e.versions[at] if e.versions else it
        cut.append(seg)
        at += len(ids)
    return {"iteration": it, "sample": sample, "env": e.env, "seed": e.seed,
            "reward": e.reward, "turn_rewards": list(e.turn_rewards),
            "finish_reason": e.finish_reason, "turns": e.turns, "tokens": len(e.token_ids),
            "policy_tokens": e.num_policy_tokens, "info": dict(e.info),
            "actions": list(e.actions), "text": dec(e.token_ids),
            "turn_versions": [c["version"] for c in cut if c["trained"]], "segments": cut}


def sample_file(out: Path, it: int, replica: Optional[int] = None) -> Path:
    """Iteration ``it``'s file: rank 0's (``replica`` None) or that replica's."""
    tail = "" if replica is None else f".r{replica}"
    return Path(out) / SAMPLES_DIR / f"iter_{it:06d}{tail}.jsonl"


def read_samples(out: Path, it: int, replica: Optional[int] = None) -> list[dict]:
    """The samples written for iteration ``it`` (tests, tools)."""
    return [json.loads(line)
            for line in sample_file(out, it, replica).read_text().splitlines()]


def _stale(out: Path, it: int, replicas: Optional[int]) -> list[Path]:
    """Iteration ``it``'s files that the current writers do not write: the replica files when
    rank 0 alone writes (``replicas`` None), else the plain file and replicas >= ``replicas``."""
    folder = Path(out) / SAMPLES_DIR
    found = list(folder.glob(f"iter_{it:06d}.r*.jsonl"))
    if replicas is None:
        return found
    plain = sample_file(out, it)
    return [plain] * plain.exists() + [
        f for f in found
        if not f.name.split(".r")[1].split(".")[0].isdigit()
        or int(f.name.split(".r")[1].split(".")[0]) >= replicas]


class SampleWriter:
    """The writer of each iteration's samples: rank 0's (``enabled``), or with
    ``all_replicas`` each replica's leader's; a no-op elsewhere or with per_iteration 0.
    ``view``: the live view (trainer/live.py), shown the last sample written."""

    def __init__(self, out: Path, per_iteration: int, tokenizer, view=None, *,
                 enabled: bool = True, all_replicas: bool = False):
        self.out, self.n, self.tok, self.view = Path(out), per_iteration, tokenizer, view
        self.enabled = enabled and per_iteration > 0
        self.all_replicas = all_replicas and per_iteration > 0

    def write(self, it: int, ids: Sequence[int], episodes: Sequence[Episode],
              replica: Optional[tuple[int, int, bool]] = None) -> Optional[Path]:
        """Iteration ``it``'s samples from this rank's (``ids``, ``episodes``); the file, or
        None when nothing was written. ``replica``: (this rank's replica, the replicas, whether
        this rank leads it) of the layout that holds the batch; needed with all_replicas."""
        if self.all_replicas:
            if replica is None:
                raise ValueError("SampleWriter(all_replicas=True).write needs replica=(index, "
                                 "count, leader)")
            index, count, leader = replica
            if not leader:
                return None
            f, stale = sample_file(self.out, it, index), \
                (_stale(self.out, it, count) if index == 0 else [])
        elif self.enabled:
            f, stale = sample_file(self.out, it), _stale(self.out, it, None)
        else:
            return None
        by_id = dict(zip(ids, episodes, strict=True))
        rows = [decode_sample(it, s, by_id[s], self.tok) for s in pick(list(by_id), self.n)]
        if not rows:
            return None
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        os.replace(tmp, f)
        for old in stale:
            old.unlink(missing_ok=True)
        if self.view is not None:
            self.view.sample(rows[-1])
        return f
