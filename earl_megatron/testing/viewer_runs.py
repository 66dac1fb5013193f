"""A run directory made without training, for the viewer's unit tests and benchmarks/viewer.py.

metrics.jsonl records carry the keys trainer/record.py writes (layouts per stage that switch,
the selector's reasons, predicted memory, seconds per stage, staleness, loss, kl, entropy,
clip fraction, the tool metrics); eval.json has start/iter/end evaluations; the samples are
calculator episodes (a <calc> tool call, the tool's <result>, an answer) written by the real
trainer/samples.SampleWriter with the tiny tool tokenizer, spread over ``replicas`` replica
files when > 1 (run.samples_all_replicas). Deterministic in its arguments.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from earl_megatron.rollout.agent_loop import Episode
from earl_megatron.trainer import segments as run_segments
from earl_megatron.trainer.samples import SampleWriter

LAYOUTS = ("TP1", "DP2", "TP2")


def calculator_episode(tok, seed: int, a: int, b: int, answer: int, *, version: int = 0
                       ) -> Episode:
    """One tool-call episode: question, <calc>, <result>, <answer> (reward 1 when right)."""
    prompt = tok.apply_chat_template([{"role": "user", "content": f"compute {a}*{b}"}],
                                     add_generation_prompt=True, tokenize=False)
    tool = f"<|end|><|user|><result>{a * b}</result><|end|><|assistant|>"
    pieces = [(prompt, 0), (f"<calc>{a}*{b}</calc>", 1), (tool, 0),
              (f"<answer>{answer}</answer><|end|>", 1)]
    ids, mask = [], []
    for text, m in pieces:
        got = tok.encode(text, add_special_tokens=False)
        ids += got
        mask += [m] * len(got)
    right = answer == a * b
    return Episode(env="calculator", seed=seed, token_ids=tuple(ids), loss_mask=tuple(mask),
                   logprobs=tuple(-0.5 * m for m in mask), reward=1.0 if right else 0.0,
                   turns=2, finish_reason="done" if seed % 7 else "max_turns",
                   prompt_length=mask.index(1),
                   actions=(f"<calc>{a}*{b}</calc>", f"<answer>{answer}</answer>"),
                   observations=(f"compute {a}*{b}", f"<result>{a * b}</result>"),
                   info={"correct": right, "tool_calls": 1, "tool_error": False},
                   turn_rewards=(0.0, 1.0 if right else 0.0),
                   versions=tuple(version if m else -1 for m in mask))


def record(it: int, rng: random.Random) -> dict:
    """A metrics line of iteration ``it`` with trainer/record.py's keys."""
    train = LAYOUTS[(it // 7) % len(LAYOUTS)]
    rollout = LAYOUTS[(it // 11) % 2]
    acc = min(1.0, 0.2 + it / 250 + rng.uniform(-0.05, 0.05))
    return {"iteration": it, "layouts": {"rollout": rollout, "logprob": train, "train": train},
            "reward": acc, "win_rate": 0.0, "illegal_rate": 0.0,
            "unparsable_rate": rng.uniform(0, 0.1), "accuracy": acc,
            "tool_calls": 1.0 + rng.uniform(0, 0.5), "tool_error_rate": rng.uniform(0, 0.05),
            "mean_context": 100 + it, "max_context": 140 + 2 * it,
            "staleness_mean": 0.5, "staleness_max": 1, "kl": 0.01 * rng.random(),
            "entropy": 1.5 - it / 400, "loss": rng.uniform(-0.1, 0.1),
            "grad_norm": rng.uniform(0.5, 2), "ratio_mean": 1.0,
            "clip_fraction": rng.uniform(0, 0.1),
            "seconds": {"plan+switch": 0.01, "rollout": 1 + rng.random(),
                        "logprob": 0.3, "switch": 0.05, "train": 0.8 + rng.random(),
                        "total": 3.2},
            "predicted_memory_gb": {"rollout": 1.1, "logprob": 0.6, "train": 2.0 + it / 100},
            "layout_reasons": {"train": f"{train}: fastest predicted that fits the budget",
                               "rollout": f"{rollout}: fastest predicted"},
            "recompute": {"train": "none"}}


def write_run(out, iterations: int, samples_per_iteration: int, replicas: int = 1,
              seed: int = 0) -> Path:
    """A finished run of ``iterations`` with ``samples_per_iteration`` samples each (over
    ``replicas`` files when > 1) in ``out``; the folder."""
    from earl_megatron.rollout.tokenizer import tool_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng, tok = random.Random(seed), tool_tokenizer()
    (out / "resolved.json").write_text(json.dumps(
        {"run": {"iterations": iterations}, "env": {"name": "calculator"},
         "algorithm": {"name": "grpo"}}))
    per = max(samples_per_iteration // replicas, 1) if samples_per_iteration else 0
    writer = SampleWriter(out, per, tok, all_replicas=replicas > 1)
    with open(out / "metrics.jsonl", "w") as f:
        for it in range(iterations):
            f.write(json.dumps(record(it, rng)) + "\n")
            if not per:
                continue
            for d in range(replicas):
                ids = list(range(d * per, (d + 1) * per))
                eps = [calculator_episode(tok, 1000 * it + s, rng.randint(2, 40),
                                          rng.randint(2, 40), rng.randint(4, 1600),
                                          version=it) for s in ids]
                writer.write(it, ids, eps, (d, replicas, True))
    run_segments.write_evals(out, {"start": {"calculator/greedy": {"accuracy": 0.1,
                                                                   "tool_calls": 1.0}},
                                   "end": {"calculator/greedy": {"accuracy": 0.6,
                                                                 "tool_calls": 1.1}}})
    return out
