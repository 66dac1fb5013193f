"""k=0 parity: with ``algorithm.max_staleness: 0`` (the synchronous loop) the trainer reproduces,
iteration for iteration, the records of the synchronous trainer as it was before the loop was
rewritten (issue #43: "with k=0 every record equals today's value for value"). Four 2-rank runs
of 3 iterations each, launched once:

- ``demo``: the CPU demo's choices (recipes/config.yaml: Connect Four against a random
  opponent, REINFORCE++, layout=auto under the demo's 0.25 GB per-rank budget, lr 1e-2,
  length-grouped micro-batches of 2048 tokens) at test size (vocab 32, 8 episodes of at most
  4 turns);
- ``grpo``: the same game trained by GRPO (groups of 2 episodes that share a seed), static
  layouts;
- ``calculator``: the tool-use environment (recipes/tool_use.yaml's model and env choices:
  the tool tokenizer, 2 operands, tags, no system prompt) after a warm start of 40 steps on
  the expert's traces, under layout=auto, REINFORCE++ at lr 1e-2, 8 episodes of at most 4 turns;
- ``agent``: ``env.name=agent`` with the test agent programs of
  earl_megatron/testing/agents.py (``AGENT_TASKS``: plain, post, builtin, one call each),
  rollout tp2 (the leader serves the endpoint, the other rank decodes beside it), re-scored
  (old_logprobs=recompute). ``rollout.agent_concurrency=1``: the episodes play one after
  another, so every decode batch holds one request and batch k is the k-th call. At the
  default concurrency the broker batches whatever requests have arrived (agents/broker.py:
  all open episodes waiting, or 20 ms after the first), in arrival order, and a row's
  sampling seed is (batch index, row in the batch) (embedded_engine.py, seeds.py): which
  tokens an episode samples would then depend on the order in which the agents' threads
  reach the endpoint, which no config fixes.

Golden files (tests/distributed/golden/async_parity_CASE.json; each records its ``commit``):

    demo, grpo          generated at 7974335 (the synchronous trainer before asynchronous RL;
                        they still pass at d96fc9f)
    calculator, agent   generated at d96fc9f (the last commit with trainer/runner.py's and
                        trainer/split_loop.py's loops, before the one loop of issue #43)

each generated twice and compared byte for byte before it was committed.

A golden file holds one CPU's floats. ``CASE.CPU.json``, where it exists for the CPU kernels
torch picks here (``torch.backends.cpu.get_cpu_capability()``), is read instead of
``CASE.json``. ``async_parity_{calculator,agent}.AVX2.json`` were generated at d96fc9f on a
host whose torch picks AVX2 (an AMD EPYC without AVX-512), where d96fc9f's own code does not
reproduce the files generated on the earlier sessions' hosts: in the calculator the warm start's
40 Adam steps round their last bits otherwise and iteration 0 samples other tokens (reward
-0.875 against -0.5), which no tolerance on the records could cover; the agent's iteration-2
gradient norm moves by 2.2e-6 relative, over the tolerance below. demo and grpo reproduce their
files on both. Generate a CPU's own files with ``--per-cpu``, from d96fc9f's checkout as below.

Each rank's history of each run (the records ``earl_megatron.train.run`` returns, one per
iteration; the ranks' records differ in ``dispatch_bytes``, what that rank received) minus the
keys measured in wall time (``TIMING_KEYS``) equals that rank's history in its golden file:
integers, booleans, strings (layouts, the selector's reasons, whose predicted seconds come from
the analytic time model, not a clock) exactly, floats within rel 1e-6 / abs 1e-7. Why a
tolerance at all: on one machine two runs are bit-identical, but a CPU with other vector units
(AVX-512 against AVX2, another BLAS kernel) may sum in another order and round the last bits
differently; anything a loop change breaks (another batch, another policy version, another
order of updates) moves the gradient norms and policy ratios by far more than 1e-6 (a learning
rate 0.1% off moves iteration 1's gradient norm by 1.3e-4 relative).

Regenerating golden files (only when the synchronous numbers are MEANT to change, e.g. a new
model init; never to make this test pass after a trainer change), from the checkout whose code
should be golden:

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python tests/distributed/test_async_parity.py \
        [CASE ...]

(default: every case). The files are written next to the script (a copy of it in /tmp run with
``PYTHONPATH=<an older checkout>`` generates that checkout's records without touching it; the
``commit`` recorded is the imported package's). The generator runs the same configs with
``algorithm.max_staleness`` left out when the config does not know it (it did not exist at
7974335) and set to 0 when it does; the test itself always passes ``STALENESS`` explicitly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

from earl_megatron.config.train import AlgorithmConfig, TrainConfig
from earl_megatron.testing.multiproc import run_distributed

GOLDEN = Path(__file__).resolve().parent / "golden"

STALENESS = {"max_staleness": 0}
"""The asynchronous trainer's switch, off: every run of this test passes it explicitly."""

TIMING_KEYS = frozenset({
    "seconds",          # {stage: wall seconds} of the iteration (record.StageTimer)
    "weight_sync_s",    # the weight sync's wall seconds (trainer/rollout.weight_sync_metrics)
    "predicted_seconds",  # the selector's stage times, scaled by its profile of measured ones
    "measured_memory_gb",  # a GPU's peak allocated memory per stage (allocator-dependent)
})
"""Top-level record keys measured in wall time, left out of the comparison. Every other key of
a record at 7974335 is a function of the config and the seed (``test_timing_keys_are_known``
fails on a new key whose name says it is a time, so it gets listed here, or renamed)."""

ADDED_KEYS = frozenset({"staleness_mean", "staleness_max", "staleness_shares"})
"""Record keys the asynchronous trainer added after 7974335: not compared against the golden
files generated before it (demo, grpo), except that at k=0 every trained token is fresh
(``check_added_at_k0``); compared like every other key against the files of d96fc9f, which hold
them. Any other key missing from a record, or new in it, fails the test: list a new metric here
once its k=0 value is known."""

NOT_TIMING = frozenset({"agent_timeouts"})
"""Key names that look like a time but count something: ``agent_timeouts`` is the number of
episodes whose agent ran past ``rollout.agent_timeout_s`` (0 in every golden record)."""

TIMING_HINTS = ("second", "time", "elapsed", "wall", "per_s", "throughput", "profile", "clock")
"""Substrings of a key name that say it is measured in wall time (besides a "_s"/"_ms" suffix)."""


def _connect_four(eval_opponents=("random",)) -> dict:
    # recipes/env/connect_four.yaml's kwargs; evaluation: random only (mcts is slow), 1 episode
    return {"name": "connect_four",
            "kwargs": {"opponent": "random", "invalid_penalty": -1.0, "legal_move_reward": 0.1,
                       "show_history": False, "system_prompt": ""},
            "eval_opponents": list(eval_opponents)}


def _run_cfg(out: str) -> dict:
    # checkpoints: only the final one (0: at the end and on SIGTERM); evaluation: start and end
    # with 1 episode per opponent and mode (it does not touch the training streams)
    return {"seed": 0, "iterations": 3, "output_dir": out, "checkpoint_every": 0,
            "eval_every": 0, "eval_episodes": 1, "live_view": False, "resume": False,
            "samples_per_iteration": 0}


CASES = {
    "demo": lambda out: {
        "model": {"vocab_size": 32},
        "layout": {"mode": "auto", "memory_budget_gb": 0.25},
        "env": _connect_four(),
        "rollout": {"engine": "embedded", "episodes_per_iteration": 8, "max_turns": 4},
        "algorithm": {"name": "reinforce_pp", "lr": 1.0e-2, "micro_batch_tokens": 2048},
        "run": _run_cfg(out),
    },
    "grpo": lambda out: {
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp2"},
        "env": _connect_four(),
        "rollout": {"engine": "embedded", "episodes_per_iteration": 8, "max_turns": 4},
        "algorithm": {"name": "grpo", "group_size": 2, "lr": 1.0e-2, "micro_batch_size": 4},
        "run": _run_cfg(out),
    },
    "calculator": lambda out: {
        "model": {"vocab_size": 64, "num_attention_heads": 4, "num_query_groups": 2},
        "layout": {"mode": "auto", "memory_budget_gb": 0.25},
        "env": {"name": "calculator",
                "kwargs": {"num_operands": 2, "max_operand": 99, "max_tool_calls": 4,
                           "invalid_penalty": -1.0, "tool_format": "tags",
                           "system_prompt": "", "expert_tool_rate": 0.5,
                           "mental_accuracy": 0.1},
                "eval_opponents": []},
        "rollout": {"engine": "embedded", "tokenizer": "tool", "episodes_per_iteration": 8,
                    "max_turns": 4, "max_action_tokens": 16},
        "algorithm": {"name": "reinforce_pp", "lr": 1.0e-2, "micro_batch_size": 4},
        # a short warm start on the expert's traces: the initial policy never writes a tag
        # (every episode unparsable, reward -1, no gradient); after it some episodes call the
        # calculator or answer
        "sft": {"steps": 40, "batch_size": 16, "expert_episodes": 128, "log_every": 10},
        "run": _run_cfg(out),
    },
    "agent": lambda out: {
        "model": {"vocab_size": 128},
        "layout": {"mode": "static", "rollout": "tp2", "logprob": "dp2", "train": "dp2"},
        "env": {"name": "agent",
                "kwargs": {"entry": "earl_megatron.testing.agents:probe",
                           "tasks": _tasks_path(out),
                           "reward": "earl_megatron.testing.agents:score"},
                "eval_opponents": []},
        "rollout": {"engine": "embedded", "tokenizer": "ascii", "episodes_per_iteration": 8,
                    "max_turns": 3, "max_action_tokens": 6, "max_context_tokens": 256,
                    "agent_concurrency": 1},
        "algorithm": {"name": "reinforce_pp", "lr": 1.0e-2, "micro_batch_size": 2,
                      "old_logprobs": "recompute"},
        "run": _run_cfg(out),
    },
}
"""Each case's config as a dict, given its output_dir, without the staleness key."""

AGENT_TASKS = ({"kind": "plain", "prompt": "say hi"},
               {"kind": "post", "prompt": "say hi"},
               {"kind": "builtin", "prompt": "say hi"})
"""The agent run's tasks (earl_megatron/testing/agents.py ``probe``): one call each, rewards 1
(returned), 0.5 (posted to {base}/reward) and 0.25 (the built-in agent scored by ``score``). An
episode plays ``tasks[seed % 3]`` and iteration i's seeds are ``i * 10_007 + k`` (seeds.py), so
the three iterations' reward means differ; the policy's samples are what the gradients see."""


def _tasks_path(out: str) -> str:
    return f"{out}.tasks.jsonl"


def _prepare(root: str, cases) -> None:
    """Write the files the cases' configs name (before any rank starts)."""
    if "agent" in cases:
        Path(root).mkdir(parents=True, exist_ok=True)
        Path(_tasks_path(f"{root}/agent")).write_text(
            "".join(json.dumps(t) + "\n" for t in AGENT_TASKS))


def _with(d: dict, algorithm_extra: dict) -> dict:
    return {**d, "algorithm": {**d["algorithm"], **algorithm_extra}}


def _train_all(root: str, algorithm_extra: dict, cases=tuple(CASES)) -> dict:
    from earl_megatron.train import run

    return {case: run(TrainConfig.from_dict(_with(CASES[case](f"{root}/{case}"),
                                                  algorithm_extra)))
            for case in cases}


def _json(x):
    """What the record is as JSON (tuples -> lists, numpy/torch scalars refused)."""
    return json.loads(json.dumps(x))


def strip_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in _json(h).items() if k not in TIMING_KEYS} for h in history]


def _close(a, b, where: str, problems: list[str]) -> None:
    """Compare golden ``a`` with actual ``b``: floats rel 1e-6 / abs 1e-7, the rest exactly."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            problems.append(f"{where}: keys differ: only golden {sorted(set(a) - set(b))}, "
                            f"only now {sorted(set(b) - set(a))}")
        for k in sorted(set(a) & set(b)):
            _close(a[k], b[k], f"{where}.{k}", problems)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            problems.append(f"{where}: length {len(a)} golden, {len(b)} now")
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]", problems)
    elif isinstance(a, float) and isinstance(b, float):
        if not (a == b or (math.isnan(a) and math.isnan(b))
                or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)):
            problems.append(f"{where}: golden {a!r}, now {b!r} (diff {b - a:.3g})")
    elif type(a) is not type(b) or a != b:
        problems.append(f"{where}: golden {a!r} ({type(a).__name__}), now {b!r} "
                        f"({type(b).__name__})")


def check_added_at_k0(rec: dict) -> None:
    """With max_staleness 0 every trained token was sampled by the policy it trains."""
    if "staleness_max" in rec:
        assert rec["staleness_max"] == 0, rec
    if "staleness_mean" in rec:
        assert rec["staleness_mean"] == 0, rec


def compare(golden: list[dict], now: list[dict]) -> list[str]:
    problems: list[str] = []
    _close(golden, now, "history", problems)
    return problems


def _nontrivial(case: str, hist: list[dict]) -> None:
    """The golden numbers can catch a change: every update had a signal and moved the policy,
    the episodes differ from iteration to iteration. REINFORCE++'s loss is ~1e-7 by construction
    (one on-policy epoch: ratio 1, batch-normalised advantages of mean 0, so the surrogate is
    their mean); its gradient is not, and the gradient norms are compared to 1e-6."""
    assert [h["iteration"] for h in hist] == [0, 1, 2], case
    assert all(h["loss"] != 0 for h in hist), (case, [h["loss"] for h in hist])
    if case == "grpo":
        assert all(abs(h["loss"]) > 1e-2 for h in hist), [h["loss"] for h in hist]
    assert all(h["grad_norm"] > 0.1 for h in hist), (case, [h["grad_norm"] for h in hist])
    assert len({h["grad_norm"] for h in hist}) == len(hist), case
    assert len({h["reward"] for h in hist}) > 1, (case, [h["reward"] for h in hist])
    assert len({h["mean_context"] for h in hist}) > 1, case
    if case == "agent":   # every agent made its one call and none was lost (error, timeout)
        for h in hist:
            assert (h["agent_errors"], h["agent_timeouts"]) == (0, 0), h
            assert h["agent_calls_per_episode"] == 1.0, h


def _cpu() -> str:
    """torch's CPU kernel set here ("AVX2", "AVX512", ...): it decides how float sums round."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _golden_path(case: str, per_cpu: bool) -> Path:
    """``CASE.CPU.json`` (this CPU's kernels, module docstring) or ``CASE.json``."""
    return GOLDEN / (f"async_parity_{case}.{_cpu()}.json" if per_cpu
                     else f"async_parity_{case}.json")


def _load(case: str) -> dict:
    own = _golden_path(case, per_cpu=True)
    return json.loads((own if own.exists() else _golden_path(case, per_cpu=False)).read_text())


def test_golden_files_are_nontrivial():
    for path in sorted(GOLDEN.glob("async_parity_*.json")):
        case = path.name.removeprefix("async_parity_").split(".")[0]
        make, g = CASES[case], json.loads(path.read_text())
        assert len(g["histories"]) == 2, case
        for hist in g["histories"]:
            _nontrivial(case, hist)
        # the ranks agree on everything but what each received
        assert [{**h, "dispatch_bytes": 0} for h in g["histories"][0]] == \
            [{**h, "dispatch_bytes": 0} for h in g["histories"][1]], case
        # the test's config is the generator's (a config edit needs regenerated files)
        assert g["config"] == _with(make("OUT"), {}), case
        if case == "agent":
            assert g["agent_tasks"] == [dict(t) for t in AGENT_TASKS]


def _timed_keys(x, where="") -> list[str]:
    if isinstance(x, list):
        return [k for v in x for k in _timed_keys(v, where)]
    if not isinstance(x, dict):
        return []
    out = []
    for k, v in x.items():
        low = k.lower()
        if k not in NOT_TIMING and (any(s in low for s in TIMING_HINTS)
                                    or low.endswith(("_s", "_ms"))):
            out.append(f"{where}{k}")
        out += _timed_keys(v, f"{where}{k}.")
    return out


def test_timing_keys_are_known():
    for case in CASES:
        timed = _timed_keys(_load(case)["histories"])
        assert not timed, (case, timed, "list them in TIMING_KEYS, or rename them")


def test_max_staleness_0_reproduces_the_synchronous_trainer(tmp_path):
    _prepare(str(tmp_path), CASES)
    # four 3-iteration runs in one launch: ~3 CPU minutes on an idle 2-core machine; the limit
    # only catches a hang
    results = run_distributed(_train_all, 2, str(tmp_path), STALENESS, timeout=2400)
    for case in CASES:
        golden = _load(case)["histories"]
        for rank, result in enumerate(results):
            now = strip_timing(result[case])
            for h in now:
                check_added_at_k0(h)
            # the keys added after a golden file's commit are left out (ADDED_KEYS)
            now = [{k: v for k, v in h.items() if k not in ADDED_KEYS or k in g}
                   for h, g in zip(now, golden[rank] + [{}] * len(now))]
            problems = compare(golden[rank], now)
            assert not problems, (f"{case}, rank {rank}: {len(problems)} differences:\n"
                                  + "\n".join(problems[:40]))


# ------------------------------------------------------------------ the generator
def _commit() -> str:
    """The commit of the code under test (the imported package's checkout), "+dirty" when its
    tracked files differ from it."""
    import earl_megatron

    where = Path(earl_megatron.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=where, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def generate(root: str, cases, per_cpu: bool = False) -> None:
    known = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    extra = STALENESS if set(STALENESS) <= known else {}
    _prepare(root, cases)
    results = run_distributed(_train_all, 2, root, extra, tuple(cases), timeout=2400)
    GOLDEN.mkdir(exist_ok=True)
    for case in cases:
        hists = [strip_timing(r[case]) for r in results]
        for hist in hists:
            _nontrivial(case, hist)
        doc = {"about": "tests/distributed/test_async_parity.py: the synchronous trainer's "
                        "records, timing keys left out; regenerate only by its __main__",
               "commit": _commit(), "algorithm_extra": extra,
               "excluded_keys": sorted(TIMING_KEYS),
               "config": _with(CASES[case]("OUT"), {}), "histories": hists}
        if case == "agent":
            doc["agent_tasks"] = [dict(t) for t in AGENT_TASKS]
        if per_cpu:
            doc["cpu_capability"] = _cpu()
        path = _golden_path(case, per_cpu)
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path} ({len(hists)} ranks x {len(hists[0])} records)")


if __name__ == "__main__":
    import argparse
    import os
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")   # as tests/conftest.py
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    ap = argparse.ArgumentParser(description="Regenerate golden files (module docstring).")
    ap.add_argument("cases", nargs="*", help=f"cases to regenerate, of {list(CASES)} "
                                             "(default: all)")
    ap.add_argument("--root", help="keep the runs' output here (default: a temporary dir)")
    ap.add_argument("--per-cpu", action="store_true",
                    help="write CASE.CPU.json, the records on this CPU's kernels (torch's "
                         "get_cpu_capability), read instead of CASE.json on such CPUs")
    a = ap.parse_args()
    if set(a.cases) - set(CASES):
        ap.error(f"unknown cases {sorted(set(a.cases) - set(CASES))}: use {list(CASES)}")
    a.cases = a.cases or list(CASES)
    if a.root:
        generate(a.root, a.cases, a.per_cpu)
    else:
        with tempfile.TemporaryDirectory(prefix="earl-parity-") as d:
            generate(d, a.cases, a.per_cpu)
