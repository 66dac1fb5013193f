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
other episodes' tokens are never touched. Invariants: one file per iteration, written whole
(temporary name, then renamed), so an iteration replayed after a resume replaces its file and
no sample appears twice; ``per_iteration`` = 0 writes nothing and creates no folder.
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


def sample_file(out: Path, it: int) -> Path:
    return Path(out) / SAMPLES_DIR / f"iter_{it:06d}.jsonl"


def read_samples(out: Path, it: int) -> list[dict]:
    """The samples written for iteration ``it`` (tests, tools)."""
    return [json.loads(line) for line in sample_file(out, it).read_text().splitlines()]


class SampleWriter:
    """Rank 0's writer of each iteration's samples; a no-op elsewhere or with per_iteration 0.
    ``view``: the live view (trainer/live.py), shown the last sample written."""

    def __init__(self, out: Path, per_iteration: int, tokenizer, view=None, *,
                 enabled: bool = True):
        self.out, self.n, self.tok, self.view = Path(out), per_iteration, tokenizer, view
        self.enabled = enabled and per_iteration > 0

    def write(self, it: int, ids: Sequence[int], episodes: Sequence[Episode]) -> Optional[Path]:
        """Iteration ``it``'s samples from this rank's (``ids``, ``episodes``); the file, or
        None when nothing was written."""
        if not self.enabled:
            return None
        by_id = dict(zip(ids, episodes, strict=True))
        rows = [decode_sample(it, s, by_id[s], self.tok) for s in pick(list(by_id), self.n)]
        if not rows:
            return None
        f = sample_file(self.out, it)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        os.replace(tmp, f)
        if self.view is not None:
            self.view.sample(rows[-1])
        return f
