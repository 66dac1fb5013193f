"""Asynchronous RL: what algorithm.max_staleness = k buys over the synchronous loop, and what
rollout.env_concurrency buys when tools are slow.

Section 1 (``--section async``). Two workloads, each trained three ways with the same seed,
iterations and configuration except ``algorithm.max_staleness`` (all three with
``algorithm.off_policy=decoupled`` and ``old_logprobs=recompute``, so only k differs): sync
(k = 0), k = 1, k = 2. Every run is the real trainer (``earl_megatron.train.run``) on 2 gloo
ranks (``testing.multiproc.run_distributed``), the tiny model, the static layout rollout dp2,
logprob dp2, train tp2 (colocated: both ranks roll out, then both train):

    tool latency   env calculator, env.kwargs.tool_latency_s (0.1 s a calculator call), the
                   tool tokenizer; a short supervised warm start on the calculator's expert
                   (expert_tool_rate 1: it always calls the tool, then answers) so the policy
                   does call the tool and the rollout's time goes to the tool's waits
    connect four   env connect_four against the random opponent: game lengths have a long tail

Printed per run, over the iterations after the first (iteration 0 is warm-up):
  - trained episodes/s: rollout.episodes_per_iteration x those iterations / the wall seconds of
    those iterations (rank 0's ``seconds.total`` summed: the iteration loop, evaluation and
    start-up excluded);
  - each rank's idle share: the share of its iterations' wall time it spent neither decoding
    (inside the rollout engine's ``generate``, timed on that rank) nor in a stage that computes
    or moves weights (plan+switch, old_logprob, switch, train, weight_sync, timed on that rank):
    tool waits, environment steps, tokenizing, and waiting at the collectives after the rollout
    for the other replica to finish its own. Measured per rank by wrapping
    ``EmbeddedEngine.generate`` and the trainer's ``StageTimer`` in the worker processes (no
    change to the trainer);
  - staleness_mean / staleness_max of the trained tokens (means over the measured iterations,
    max of the maxima), pool_dropped summed;
  - rollout s (rank 0's rollout stage, mean per iteration), reward, the trained episodes'
    mean/max context, cpu s/it (both ranks' process CPU seconds per iteration: the work; on a
    loaded host wall time drifts while this stays put);
  - the ratio of trained episodes/s to the sync baseline's, from the same run of this script
    (the machine is noisy: compare within one run). The sync run is repeated last (sync') and
    the baseline is the two sync runs' harmonic-mean rate, which brackets a load that drifts
    during the script (``--no-bracket``: one sync run). The ratios are printed once every run
    of a workload is done (the baseline needs sync'), on the line after its table.

Section 2 (``--section env``). A user's environment through ``env.name=module:factory``
(``benchmarks.async_rl:slow_tool``, below: a tool that answers every action after
``latency_s``, episodes of exactly ``turns`` turns), 16 episodes, 4 turns, 2 ranks (rollout dp2),
synchronous: the rollout stage's seconds (the slower rank's, median over iterations 1..5)
with rollout.env_concurrency=1, =16, and with a
zero-latency tool; printed: what the 0.1 s latency adds to the zero-latency rollout stage in each
case (bound with concurrency: each rank steps its episodes' tools of a turn together, so it adds
one latency per turn: 4 x 0.1 s = 0.4 s per rank, at most 2 x 4 x 0.1 = 0.8 s).

Section 4 (``--section split``). Split placement (trainer/split.py) against the
synchronous loop, both workloads, the same configuration but the placement: sync is the
colocated loop on 2 ranks (every stage dp2; k = 0); "split 1" and "split 2" run on 3 ranks with
1 or 2 of them as the rollout pool (``rollout.placement=split``, each pool in the layout the
selector gives that split: 1 -> rollout dp1 + train dp2, 2 -> rollout dp2 + train dp1; k = 1);
"auto" runs on the same 3 ranks with ``rollout.placement=auto`` (the selector picks the split
and the layouts, and re-plans at every iteration from what the pools measured). This host has 2
cores: a 1 + 1 split would leave one rank to train what two train colocated, so the comparison
adds a process that mostly waits (on tools) rather than moving half the trainer onto it; cpu
s/it (every rank's process CPU seconds per iteration, start-up included) is printed beside the
rates to show what each run spent. The tool workload's latency (``--split-latency``, default
0.15 s a call, with ``--split-episodes`` 16 a batch and ``--split-iterations`` 8) is set so
that the synchronous rollout stage is as long as the rest of the iteration or somewhat longer
(printed: rollout s and train s of the sync run; 0.23 s and 0.12-0.15 s here): overlap can then
at best take the shorter side off the period (the ideal, 2x, is the balanced case). Smaller
latencies balance the sides but shrink both below the meeting's fixed cost (about 0.04 s here:
the agreement, the one dispatch of the batch, the barrier and the handoff); larger batches make
the one rollout rank decode more while the trainers compete with it for the 2 cores. Single runs
on this host spread by 10-20% (sync and sync' differ by that much). A split record's seconds are
the train pool's: its wait at the meeting for the rollout pool, the transfer, the handoff and
the training, whose total is the period; eps/s counts the same iterations as sync. Every row
runs once per seed of ``--split-seeds`` (default 0 1 2), seed by seed with every row in turn
(a load that drifts during the script weighs on every row alike), and pools them: all the
episodes its runs trained over all their seconds (printed per seed too). A seed's games are one draw of
lengths, and a batch's step grows with its longest game (Connect Four: 0.3 s at 144 tokens,
2.4 s at 669), so on one seed the splits are ranked by their draws as much as by the split.
Connect Four's rollout is a sixth of its iteration: little to overlap there, and the rollout
ranks' decoding competes with the trainers for the 2 cores. Printed: each row's ratio to sync,
and auto's to the best other placement, with auto's pools per iteration (0: colocated) and its
first plan's reason.

Section 3 (``--section plan``). The time model's projection for the 72B recipe on 128 H100
(plan/split.py, no run): seconds per iteration synchronous colocated, split on 64/64 GPUs and
auto's split, with the ratios to sync, at 2K, 8K and 32K contexts.

Its last lines: ``async: colocated k=1 / sync <X.XX>x (tool latency), <Y.YY>x (connect four)``
(trained episodes/s ratios of section 1), ``async: split k=1 / sync <X.XX>x (tool latency),
<Y.YY>x (connect four)`` (section 4: split 1), ``async: auto / best placement <A.AA> (tool
latency), <B.BB> (connect four)`` (auto against the fastest other row: sync on 2 ranks, sync and
colocated k=1 on 3, split 1, split 2) and the same on 3 ranks only (auto runs on 3).

Run:  python benchmarks/async_rl.py [--section all|async|env|plan] [--iterations 5]
      [--episodes 16] [--latency 0.1] [--workloads tool connect_four] [--ks 0 1 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from earl_megatron.envs.base import Env, StepResult

COMPUTE = ("plan+switch", "old_logprob", "switch", "train", "weight_sync", "logprob")
"""Stages that compute or move weights; with decoding, what a rank is busy with."""


class SlowToolEnv(Env):
    """A user's tool environment: every action is a tool call answered after ``latency_s``
    seconds (a remote API's round trip); the episode ends after ``turns`` calls, reward 1."""

    name = "slow_tool"

    def __init__(self, latency_s: float = 0.1, turns: int = 4):
        super().__init__()
        self.latency_s, self.turns, self.calls = float(latency_s), int(turns), 0

    @property
    def system_prompt(self) -> str:
        return ""

    def _reset(self, seed: int) -> str:
        self.calls = 0
        return f"task {seed % 97}"

    def _step(self, action: str) -> StepResult:
        if self.latency_s:
            time.sleep(self.latency_s)
        self.calls += 1
        done = self.calls >= self.turns
        return StepResult("ok", 1.0 if done else 0.0, done, {})


def slow_tool(**kwargs) -> SlowToolEnv:
    """``env.name=benchmarks.async_rl:slow_tool`` (the registry's module:factory)."""
    return SlowToolEnv(**kwargs)


# ---------------------------------------------------------------------- one training run
def _train(cfg_dict: dict) -> dict:
    """On every rank: the trainer's run, with this rank's decode and stage seconds."""
    import earl_megatron.rollout.embedded_engine as ee
    import earl_megatron.trainer.colocated as colocated
    import earl_megatron.trainer.split as split
    from earl_megatron.config.train import TrainConfig
    from earl_megatron.train import run

    decode = [0.0]
    per_it: list[dict] = []
    gen = ee.EmbeddedEngine.generate

    def timed_generate(self, *a, **k):
        t = time.perf_counter()
        try:
            return gen(self, *a, **k)
        finally:
            decode[0] += time.perf_counter() - t

    ee.EmbeddedEngine.generate = timed_generate
    base_timer = colocated.StageTimer

    class Timer(base_timer):
        def __init__(self, carried=None):
            super().__init__(carried)
            decode[0] = 0.0
            self.cpu0 = time.process_time()

        def total(self):
            tot = super().total()
            per_it.append({"seconds": dict(tot), "decode": decode[0],
                           "cpu": time.process_time() - self.cpu0})
            return tot

    colocated.StageTimer = split.StageTimer = Timer   # the placements time their iterations
    cpu0 = time.process_time()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # the live view
        hist = run(TrainConfig.from_dict(cfg_dict))
    return {"history": hist, "ranks": per_it, "cpu": time.process_time() - cpu0}


def _config(workload: str, k: int, args, out: str) -> dict:
    common_alg = {"micro_batch_size": 4, "old_logprobs": "recompute", "off_policy": "decoupled",
                  "max_staleness": k}
    run = {"iterations": args.iterations, "output_dir": out, "checkpoint_every": 0,
           "eval_episodes": 2, "live_view": False, "samples_per_iteration": 0, "resume": True}
    layout = {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp2"}
    if workload == "tool":
        return {
            "model": {"vocab_size": 64},
            "layout": layout,
            "env": {"name": "calculator", "eval_opponents": [],
                    "kwargs": {"tool_latency_s": args.latency, "expert_tool_rate": 1.0,
                               "max_tool_calls": 4}},
            "rollout": {"tokenizer": "tool", "episodes_per_iteration": args.episodes,
                        "max_turns": 6, "max_action_tokens": 16,
                        "env_concurrency": args.episodes},
            "algorithm": {**common_alg, "name": "grpo", "group_size": 2, "lr": 1e-3},
            "sft": {"steps": args.sft_steps, "expert_episodes": 128, "batch_size": 16,
                    "lr": 1e-2, "log_every": 1000},
            "run": run,
        }
    if workload == "connect_four":
        return {
            "model": {"vocab_size": 32},
            "layout": layout,
            "env": {"name": "connect_four", "eval_opponents": [],
                    "kwargs": {"system_prompt": "", "legal_move_reward": 0.1}},
            "rollout": {"episodes_per_iteration": args.episodes, "max_turns": 16},
            "algorithm": {**common_alg, "name": "grpo", "group_size": 2},
            "run": run,
        }
    raise ValueError(workload)


def _summary(res: list[dict], skip: int, episodes: int) -> dict:
    hist = res[0]["history"]
    meas = hist[skip:]
    wall = sum(h["seconds"]["total"] for h in meas)
    idle = []
    for r in res:
        its = r["ranks"][skip:len(hist)]
        tot = sum(i["seconds"]["total"] for i in its)
        busy = sum(i["decode"] + sum(i["seconds"].get(s, 0.0) for s in COMPUTE) for i in its)
        idle.append(max(0.0, tot - busy) / tot if tot else 0.0)
    cpu = sum(i["cpu"] for r in res for i in r["ranks"][skip:len(hist)]) / len(meas)
    return {"iterations": len(meas), "wall": wall, "cpu": cpu, "eps": episodes * len(meas) / wall,
            "idle": idle,
            "rollout_s": sum(h["seconds"].get("rollout", 0.0) for h in meas) / len(meas),
            "st_mean": sum(h["staleness_mean"] for h in meas) / len(meas),
            "st_max": max(h["staleness_max"] for h in meas),
            "dropped": sum(h.get("pool_dropped", 0) for h in meas),
            "tool_calls": [h.get("tool_calls") for h in meas],
            "reward": sum(h["reward"] for h in meas) / len(meas),
            "ctx": (sum(h["mean_context"] for h in meas) / len(meas),
                    max(h["max_context"] for h in meas)),
            "stages": {k: sum(h["seconds"].get(k, 0.0) for h in meas) / len(meas)
                       for k in meas[0]["seconds"]}}


def section_async(args) -> dict:
    from earl_megatron.testing.multiproc import run_distributed

    ratios = {}
    names = {"tool": "tool latency", "connect_four": "connect four"}
    for w in args.workloads:
        print(f"\n[{names[w]}] {args.episodes} episodes/iteration, {args.iterations} iterations "
              f"(rates over iterations 1..{args.iterations - 1}), 2 ranks rollout dp2 / train "
              "tp2" + (f", tool latency {args.latency} s" if w == "tool" else ""), flush=True)
        rows = {}
        warm = None
        if w == "tool" and args.sft_steps:
            # one warm start for the three runs: each resumes from a copy of its checkpoint
            warm = tempfile.mkdtemp(prefix="earl-async-warm-")
            cfg = _config(w, 0, args, warm)
            cfg["run"].update(iterations=0, checkpoint_every=args.sft_steps)
            t = time.perf_counter()
            run_distributed(_train, 2, cfg, timeout=args.timeout)
            print(f"  (warm start: {args.sft_steps} supervised steps on the calculator's expert, "
                  f"{time.perf_counter() - t:.0f} s, once; every run starts from it)", flush=True)
        print(f"  {'run':6s} {'eps/s':>7s} {'rollout s':>9s} "
              f"{'idle r0':>7s} {'idle r1':>7s} {'st mean':>7s} {'st max':>6s} {'dropped':>7s} "
              f"{'reward':>7s} {'ctx mean/max':>12s} {'cpu s/it':>8s}", flush=True)
        order = list(args.ks) + ([0] if args.bracket and 0 in args.ks else [])
        for n, k in enumerate(order):
            again = n == len(order) - 1 and n > 0 and k == 0
            with tempfile.TemporaryDirectory(prefix="earl-async-") as tmp:
                out = tmp
                if warm is not None:
                    out = os.path.join(tmp, "run")
                    shutil.copytree(warm, out)
                res = run_distributed(_train, 2, _config(w, k, args, out),
                                      timeout=args.timeout)
            s = _summary(res, 1, args.episodes)
            if again:   # the baseline: the mean rate of the sync runs before and after
                first = rows[0]
                rows[0] = dict(first, eps=2 / (1 / first["eps"] + 1 / s["eps"]))
            else:
                rows[k] = s
            name = "sync" if k == 0 else f"k={k}"
            name = "sync'" if again else name
            print(f"  {name:6s} {s['eps']:7.2f} {s['rollout_s']:9.2f} "
                  f"{s['idle'][0]:7.2f} {s['idle'][1]:7.2f} {s['st_mean']:7.3f} "
                  f"{s['st_max']:6d} {s['dropped']:7d} {s['reward']:7.2f} "
                  f"{s['ctx'][0]:7.1f}/{s['ctx'][1]:<4d} {s['cpu']:8.2f}", flush=True)
            if args.verbose:
                print("         rank 0 seconds per iteration: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in s["stages"].items()))
                if w == "tool":
                    print(f"         tool calls per episode by iteration: {s['tool_calls']}")
        if warm is not None:
            shutil.rmtree(warm, ignore_errors=True)
        if 0 in rows:
            print(f"  sync baseline: {rows[0]['eps']:.2f} episodes/s (" + (
                "harmonic mean of sync and sync', run first and last: load drifts on a "
                "shared host" if args.bracket else "one run") + "); ratios: " + ", ".join(
                f"k={k} {rows[k]['eps'] / rows[0]['eps']:.2f}x" for k in rows if k),
                flush=True)
        if 0 in rows and 1 in rows:
            ratios[w] = rows[1]["eps"] / rows[0]["eps"]
    return ratios


# ---------------------------------------------------------------------- section 2
def _env_config(latency: float, concurrency: int, args, out: str) -> dict:
    return {
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp2"},
        "env": {"name": "benchmarks.async_rl:slow_tool", "eval_opponents": [],
                "kwargs": {"latency_s": latency, "turns": args.turns}},
        "rollout": {"episodes_per_iteration": 16, "max_turns": args.turns,
                    "env_concurrency": concurrency},
        "algorithm": {"micro_batch_size": 4},
        "run": {"iterations": args.env_iterations, "output_dir": out, "checkpoint_every": 0,
                "eval_episodes": 2, "live_view": False, "samples_per_iteration": 0},
    }


def section_env(args) -> None:
    from earl_megatron.testing.multiproc import run_distributed

    print(f"\n[concurrent environments] env.name=benchmarks.async_rl:slow_tool, 16 episodes x "
          f"{args.turns} turns, 2 ranks (rollout dp2), tool latency {args.latency} s, rollout "
          f"stage seconds (the slower rank's, median over iterations 1..{args.env_iterations - 1})",
          flush=True)
    got = {}
    for name, lat, conc in (("zero latency", 0.0, 16), ("concurrency 1", args.latency, 1),
                            ("concurrency 16", args.latency, 16)):
        with tempfile.TemporaryDirectory(prefix="earl-envc-") as tmp:
            res = run_distributed(_train, 2, _env_config(lat, conc, args, tmp),
                                  timeout=args.timeout)
        n = len(res[0]["history"])
        # each iteration's rollout stage on the slower rank (it bounds the stage); the median
        # over the measured iterations: a load spike on the shared host hits one iteration
        per_it = sorted(max(r["ranks"][i]["seconds"]["rollout"] for r in res)
                        for i in range(1, n))
        got[name] = statistics.median(per_it)
        print(f"  {name:15s} rollout {got[name]:6.2f} s  (per iteration: "
              + ", ".join(f"{x:.2f}" for x in per_it) + ")", flush=True)
    bound = 2 * args.turns * args.latency
    for name in ("concurrency 1", "concurrency 16"):
        add = got[name] - got["zero latency"]
        print(f"  latency adds with {name:15s} {add:5.2f} s to the rollout stage "
              f"(bound with concurrency: {bound:.2f} s; serial: 8 episodes x "
              f"{args.turns} x {args.latency} = {8 * args.turns * args.latency:.2f} s a rank)")


SPLITS = {1: {"mode": "static", "rollout": "dp1", "logprob": "dp2", "train": "dp2"},
          2: {"mode": "static", "rollout": "dp2", "logprob": "dp1", "train": "dp1"}}
"""Section 4's fixed splits of 3 ranks: rollout ranks -> the pools' layouts, each the one the
selector gives that split (plan_split with the pool fixed), so the fixed splits and auto differ
only in how the ranks are divided."""


def _same(a: str, b: str, ranks: int) -> bool:
    """Are layout strings ``a`` and ``b`` the same layout of ``ranks`` ranks?"""
    from earl_megatron.plan.layout import ParallelLayout
    return ParallelLayout.parse(a, world_size=ranks) == ParallelLayout.parse(b, world_size=ranks)


def _split_config(workload: str, placement, args, out: str, init=None) -> dict:
    """Section 4's run: the workload's config; placement None: colocated sync on 2 ranks,
    "sync3": colocated sync on 3 ranks, "colo": colocated k = 1 on 3 ranks (both in the
    selector's layouts), 1 or 2: that many rollout ranks of 3, "auto": the selector's placement
    of 3 ranks, colocated or a split (k = 1)."""
    cfg = _config(workload, 0 if placement in (None, "sync3") else 1, args, out)
    cfg["run"] = dict(cfg["run"], resume=False)
    if workload == "tool":
        cfg["env"]["kwargs"] = dict(cfg["env"]["kwargs"], tool_latency_s=args.split_latency)
        cfg.pop("sft")
        cfg["run"]["init"] = init   # the warm start's checkpoint: every run starts from it
    if placement is None:
        cfg["layout"] = {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "dp2"}
    elif placement in ("sync3", "colo"):
        cfg["layout"] = {"mode": "auto"}
    elif placement == "auto":
        cfg["layout"] = {"mode": "auto"}
        cfg["rollout"] = dict(cfg["rollout"], placement="auto")
    elif placement is not None:
        cfg["layout"] = SPLITS[placement]
        cfg["rollout"] = dict(cfg["rollout"], placement="split", pool_ranks=placement)
    return cfg


def _split_run(w: str, placement, args, init, ranks: int, seed: int):
    """One run of a section 4 row: ``placement`` on ``seed``. (summary, auto's plans: (seed,
    its pools and layouts by iteration, first plan, moves) or None)."""
    from earl_megatron.testing.multiproc import run_distributed

    with tempfile.TemporaryDirectory(prefix="earl-split-") as tmp:
        cfg = _split_config(w, placement, args, tmp, init)
        cfg["run"]["seed"] = seed
        res = run_distributed(_train, ranks, cfg, timeout=args.timeout)
    s = _summary(res, 1, args.episodes)
    hist = res[0]["history"]
    meas = hist[1:]
    s["cpu"] = sum(r["cpu"] for r in res) / len(hist)
    s["wait"] = 0.0
    split = [h for h in meas if "split" in h]   # auto: its split iterations
    if split:
        s["rollout_s"] = sum(h["split"]["rollout_s"] for h in split) / len(split)
        s["wait"] = sum(h["split"]["train_wait_s"] for h in split) / len(split)
    s["train"] = sum(h["seconds"].get(st, 0.0) for h in meas
                     for st in ("old_logprob", "switch", "train", "weight_sync")) / len(meas)
    plan = None
    if placement == "auto":
        plan = (seed, [(h["split"]["rollout_ranks"] if "split" in h else 0, h["layouts"])
                       for h in hist],
                hist[0]["split"]["plan"] if "split" in hist[0] else "colocated",
                [(h["iteration"], h["seconds"]["move"]) for h in hist
                 if "move" in h["seconds"]])
    return s, plan


def _pooled(runs: list[dict]) -> tuple[dict, float, float]:
    """A section 4 row from its runs, one per seed of ``--split-seeds`` (the same seeds for
    every row). Episodes/s pools the seeds (all trained episodes over all their seconds): one
    seed's games are one draw of lengths, and a batch's step grows with its longest game, so a
    single seed ranks the splits by the draw as much as by the split. The other columns average
    the seeds. (summary, train s, wait s)."""
    n = len(runs)
    pooled = {"eps": sum(r["eps"] * r["wall"] for r in runs) / sum(r["wall"] for r in runs),
              "per_seed": [r["eps"] for r in runs],
              "st_max": max(r["st_max"] for r in runs),
              "dropped": sum(r["dropped"] for r in runs)}
    for key in ("rollout_s", "st_mean", "reward", "cpu"):
        pooled[key] = sum(r[key] for r in runs) / n
    return pooled, sum(r["train"] for r in runs) / n, sum(r["wait"] for r in runs) / n


def section_split(args) -> dict:
    from earl_megatron.runtime.checkpoint_files import find_checkpoint
    from earl_megatron.testing.multiproc import run_distributed

    args = argparse.Namespace(**{**vars(args), "episodes": args.split_episodes,
                                 "iterations": args.split_iterations})
    ratios = {}
    names = {"tool": "tool latency", "connect_four": "connect four"}
    for w in args.workloads:
        print(f"\n[split: {names[w]}] {args.episodes} episodes/iteration, {args.iterations} "
              f"iterations (rates over iterations 1..{args.iterations - 1}); sync: 2 ranks "
              "colocated, dp2; on 3 ranks: sync3 and colocated k=1 in the selector's layouts, "
              "split 1 = rollout dp1 + train dp2, split 2 = rollout dp2 + train dp1 (k=1), auto "
              "= the selector's placement (colocated or a split, k=1)" +
              (f"; tool latency {args.split_latency} s" if w == "tool" else ""), flush=True)
        warm, init = None, None
        if w == "tool":
            warm = tempfile.mkdtemp(prefix="earl-split-warm-")
            cfg = _config(w, 0, args, warm)
            cfg["run"].update(iterations=0, checkpoint_every=args.sft_steps)
            run_distributed(_train, 2, cfg, timeout=args.timeout)
            init = str(find_checkpoint(os.path.join(warm, "checkpoints", "sft")).path)
        print(f"  {'run':8s} {'ranks':>5s} {'eps/s':>7s} {'rollout s':>9s} {'train s':>7s} "
              f"{'wait s':>6s} {'st mean':>7s} {'st max':>6s} {'dropped':>7s} {'reward':>7s} "
              f"{'cpu s/it':>8s}   eps/s per seed {' / '.join(map(str, args.split_seeds))}",
              flush=True)
        rows, plans = {}, []
        order = [None, 1, "auto", "colo", 2, "sync3"] + ([None] if args.bracket else [])
        # seed by seed, every row in turn: a load that drifts during the script then weighs
        # on every row alike (row by row, a row's seeds shared one stretch of it)
        runs: list[list] = [[] for _ in order]
        for seed in args.split_seeds:
            for n, placement in enumerate(order):
                runs[n].append(_split_run(w, placement, args, init,
                                          2 if placement is None else 3, seed))
        for n, placement in enumerate(order):
            again = n == len(order) - 1 and placement is None and n > 0
            ranks = 2 if placement is None else 3
            s, train, wait = _pooled([r for r, _ in runs[n]])
            plans_here = [plan for _, plan in runs[n] if plan is not None]
            if again:
                rows[None] = dict(rows[None], eps=2 / (1 / rows[None]["eps"] + 1 / s["eps"]))
            else:
                rows[placement] = s
            name = "sync'" if again else {None: "sync", 1: "split 1", 2: "split 2",
                                          "auto": "auto", "colo": "colo k=1",
                                          "sync3": "sync3"}[placement]
            print(f"  {name:8s} {ranks:5d} {s['eps']:7.2f} {s['rollout_s']:9.2f} {train:7.2f} "
                  f"{wait:6.2f} {s['st_mean']:7.3f} {s['st_max']:6d} {s['dropped']:7d} "
                  f"{s['reward']:7.2f} {s['cpu']:8.2f}   " +
                  " / ".join(f"{e:.1f}" for e in s["per_seed"]), flush=True)
            if placement == "auto":
                plans = plans_here
                same = [p for p in (1, 2) if all(
                    n_r == p and _same(lay["rollout"], SPLITS[p]["rollout"], p) and
                    _same(lay["train"], SPLITS[p]["train"], 3 - p)
                    for seed_plans in plans for n_r, lay in seed_plans[1])]
                if same:
                    print(f"           auto ran split {same[0]}'s pools and layouts at every "
                          "iteration of every seed: their ratio is this host's run-to-run "
                          "spread", flush=True)
                elif all(n_r == 0 for seed_plans in plans for n_r, _ in seed_plans[1]):
                    print("           auto ran colocated (sync3's placement) at every iteration "
                          "of every seed: its ratio to sync3 is this host's run-to-run spread",
                          flush=True)
                for seed, seed_plans, first, moves in plans:
                    print(f"           seed {seed}: auto's pools by iteration (rollout ranks, "
                          "layouts): " + ", ".join(f"{n_r} {lay['rollout']}|{lay['train']}"
                                                   for n_r, lay in seed_plans)
                          + "; moves (iteration: seconds, in its record): "
                          + (", ".join(f"{it}: {sec:.2f}" for it, sec in moves) or "none")
                          + (f"; its first plan: {first}" if seed == args.split_seeds[0]
                             else ""), flush=True)
        if warm is not None:
            shutil.rmtree(warm, ignore_errors=True)
        base = rows[None]["eps"]
        fixed = [p for p in rows if p != "auto"]
        best = max(fixed, key=lambda p: rows[p]["eps"])
        best3 = max((p for p in fixed if p is not None), key=lambda p: rows[p]["eps"])
        label = {None: "sync on 2 ranks", "sync3": "sync3", "colo": "colocated k=1",
                 1: "split 1", 2: "split 2"}
        ratios[w] = rows[1]["eps"] / base
        ratios[w + "/auto"] = rows["auto"]["eps"] / rows[best]["eps"]
        ratios[w + "/auto3"] = rows["auto"]["eps"] / rows[best3]["eps"]
        print(f"  sync baseline {base:.2f} episodes/s"
              + (" (harmonic mean of sync and sync')" if args.bracket else "")
              + "; " + ", ".join(f"{label[p]} {rows[p]['eps'] / base:.2f}x" for p in fixed
                                 if p is not None)
              + f", auto {rows['auto']['eps'] / base:.2f}x; auto / the best placement "
              f"({label[best]}) {ratios[w + '/auto']:.2f}; on 3 ranks ({label[best3]}) "
              f"{ratios[w + '/auto3']:.2f}", flush=True)
    return ratios


def section_plan(args) -> None:
    """The time model's projection for the 72B recipe on 128 H100 (plan/split.py): seconds per
    iteration synchronous colocated, split on half the GPUs, and auto's split, per context."""
    from earl_megatron.plan.presets import get_preset
    from earl_megatron.plan.selector import Selector, SelectorConfig
    from earl_megatron.plan.specs import (DecodeEngine, Stage, StageWorkload, TrainOptions,
                                          cluster_spec)
    from earl_megatron.plan.split import SplitWorkload, plan_split

    cluster = cluster_spec("h100", nodes=16, devices_per_node=8).with_(
        decode_engine=DecodeEngine.sglang_servers(0.8))
    sel = Selector(get_preset("qwen2.5-72b"), cluster, TrainOptions(distributed_optimizer=True),
                   SelectorConfig(auto_recompute=True))
    print(f"\n[projection] qwen2.5-72b recipe on {cluster.name}: 256 episodes, 32K-token "
          f"micro-batches, SGLang at --mem-fraction-static 0.8, time model only")
    print(f"  {'context':>8s} {'sync':>8s} {'split 64/64':>12s} {'auto':>24s}")
    for ctx in (2048, 8192, 32768):
        work = SplitWorkload(*(StageWorkload.of(st, ctx, 256, responses_in_flight=256,
                                                micro_batch_tokens=32768)
                               for st in (Stage.ROLLOUT, Stage.LOGPROB, Stage.TRAIN)))
        sync = plan_split(sel, work, rollout_ranks=0).period_s
        half = plan_split(sel, work, rollout_ranks=64).period_s
        auto = plan_split(sel, work)
        print(f"  {ctx:8d} {sync:7.0f}s {half:7.0f}s {sync / half:.2f}x "
              f"{auto.rollout_ranks:3d}/{auto.train_ranks:<3d} {auto.period_s:5.0f}s "
              f"{sync / auto.period_s:.2f}x")
    print("  (colocated k=1 projects as sync: the time model has no long tail for k to cut)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", choices=("all", "async", "env", "plan", "split"),
                    default="all")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.1)
    ap.add_argument("--split-latency", type=float, default=0.15)
    ap.add_argument("--split-episodes", type=int, default=16)
    ap.add_argument("--split-iterations", type=int, default=8)
    ap.add_argument("--split-seeds", nargs="+", type=int, default=[0, 1, 2],
                    help="section 4: run.seed of each run; every row pools these seeds")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--workloads", nargs="*", default=["tool", "connect_four"])
    ap.add_argument("--ks", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--env-iterations", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--verbose", action="store_true", help="stage seconds of each run")
    ap.add_argument("--no-bracket", dest="bracket", action="store_false",
                    help="skip the second sync run (run last, to bracket load drift)")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the workers' import-time warnings
    t0 = time.perf_counter()
    ratios = {}
    if args.section in ("all", "plan"):
        section_plan(args)
    if args.section in ("all", "env"):
        section_env(args)
    if args.section in ("all", "async"):
        ratios = section_async(args)
    split = section_split(args) if args.section in ("all", "split") else {}
    print(f"\n(whole run {time.perf_counter() - t0:.0f} s)")
    if ratios:
        print("async: colocated k=1 / sync "
              f"{ratios.get('tool', float('nan')):.2f}x (tool latency), "
              f"{ratios.get('connect_four', float('nan')):.2f}x (connect four)")
    if split:
        print("async: split k=1 / sync "
              f"{split.get('tool', float('nan')):.2f}x (tool latency), "
              f"{split.get('connect_four', float('nan')):.2f}x (connect four)")
        print("async: auto / best placement "
              f"{split.get('tool/auto', float('nan')):.2f} (tool latency), "
              f"{split.get('connect_four/auto', float('nan')):.2f} (connect four)")
        print("async: auto / best placement of 3 ranks "
              f"{split.get('tool/auto3', float('nan')):.2f} (tool latency), "
              f"{split.get('connect_four/auto3', float('nan')):.2f} (connect four)")


if __name__ == "__main__":
    sys.exit(main())
