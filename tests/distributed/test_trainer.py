"""The trainer end to end on 2 ranks: a short run records metrics, checkpoints, and a run resumed
from a checkpoint reproduces the uninterrupted run's metrics (with the reference model, KL and
entropy bonus on); KL to the reference in the loss and in the reward; bad config stops before
training."""

import json

import pytest

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.testing.multiproc import kill_torchrun, run_distributed


def _cfg(out, iterations, algorithm=None, cluster=None, **layout):
    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "cluster": cluster or {},
        "layout": layout or {"mode": "static", "rollout": "dp2", "logprob": "dp2",
                             "train": "tp2"},
        "env": {"name": "connect_four",
                "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"episodes_per_iteration": 4, "max_turns": 4},
        "algorithm": {"micro_batch_size": 2, **(algorithm or {})},
        "run": {"iterations": iterations, "output_dir": out, "checkpoint_every": 1,
                "eval_episodes": 2, "live_view": False},
    })


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def _strip(history):
    return [{k: v for k, v in h.items() if k not in ("seconds",)} for h in history]


KL_LOSS = {"kl_mode": "loss", "kl_coef": 0.1, "entropy_coef": 0.01}


def _check_kl(hist):
    # iteration 0: the policy that sampled IS the reference (same seed init): the reference
    # logprobs, computed in another layout, equal the engine's on every policy token
    assert abs(hist[0]["kl"]) < 1e-6 and hist[0]["ref_log_ratio_max"] < 1e-4
    # once an optimizer step had a signal, the policy has moved away from the reference (a
    # batch whose rewards are all equal and whose KL is exactly 0 has none: every advantage is
    # 0, so without an entropy bonus the first step may not move it)
    assert max(h["ref_log_ratio_max"] for h in hist[1:]) > 1e-4


KILL_RUN = ["model.vocab_size=32", "layout=static", "layout.rollout=dp2", "layout.logprob=dp2",
            "layout.train=tp2", "env.eval_opponents=[random]", "rollout.episodes_per_iteration=4",
            "rollout.max_turns=4", "algorithm.micro_batch_size=2", "algorithm.kl_mode=loss",
            "algorithm.kl_coef=0.1", "algorithm.entropy_coef=0.01", "run.iterations=3",
            "run.checkpoint_every=1", "run.eval_episodes=2", "run.live_view=false"]


def _launch(out, *extra):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "-m", "earl_megatron.train",
                             f"run.output_dir={out}", *KILL_RUN, *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def test_sigkill_mid_run_and_resume(tmp_path):
    """torchrun killed with SIGKILL during iteration 2 (after iteration 1's metrics line), then
    relaunched: the run resumes and its metrics equal an uninterrupted run's, line for line.
    kl_mode=loss and the entropy bonus are on: the reference model is rebuilt, not loaded.
    The first run plays the held Connect Four (earl_megatron/testing/envs.py): from iteration
    2's rollout on (metrics.jsonl has 2 lines) its steps wait for a stop request that never
    comes, so the kill lands in checkpoint 1 or iteration 2's rollout on any machine; the rerun
    plays the plain game (the same moves)."""
    import time

    import psutil

    part = tmp_path / "part"
    proc = _launch(part, "env.name=earl_megatron.testing.envs:held_connect_four",
                   f"+env.kwargs.hold_when={part / 'metrics.jsonl'}", "+env.kwargs.hold_lines=2")
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = part / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            break   # iteration 2 cannot complete now: its rollout holds
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
    workers = kill_torchrun(proc)
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    assert len((part / "metrics.jsonl").read_text().splitlines()) == 2   # held: never 3
    proc = _launch(part)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err.decode()[-3000:]
    resumed = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]

    # the same config, uninterrupted, through the in-process launcher
    resolved = json.loads((part / "resolved.json").read_text())
    resolved["run"]["output_dir"] = str(tmp_path / "full")
    full = run_distributed(_train, 2, TrainConfig.from_dict(resolved), timeout=400)[0]
    assert [h["iteration"] for h in resumed] == [0, 1, 2]
    assert _strip(resumed) == _strip(full)
    assert all(h["layouts"] == {"rollout": "DP2", "logprob": "DP2", "train": "TP2"}
               for h in full)
    _check_kl(full)
    assert full[1]["kl"] > 0 and all(h["entropy"] > 0 for h in full)
    assert all(h["seconds"]["logprob"] > 0 for h in full)
    assert (tmp_path / "full" / "report.png").stat().st_size > 10_000
    evals = json.loads((tmp_path / "full" / "eval.json").read_text())
    assert set(evals) == {"start", "end"} and "random/greedy" in evals["end"]


def test_kl_loss_with_a_logprob_layout_of_its_own(tmp_path):
    # three layouts: the reference scores in TP2, between a DP2 rollout and a CP2 train; the
    # distributed optimizer's state moves between the DP2 and CP2 ranges at every switch; with
    # the three layouts' groups cached the policy and the reference are re-activated in place
    cfg = _cfg(str(tmp_path / "kl"), 2, {**KL_LOSS, "use_distributed_optimizer": True},
               mode="static", rollout="dp2", logprob="tp2", train="cp2")
    hist = run_distributed(_train, 2, cfg, timeout=400)[0]
    assert hist[0]["layouts"] == {"rollout": "DP2", "logprob": "TP2", "train": "CP2"}
    # the trainer initialised the world with the device-mapped backend (runtime/dist.py)
    world = json.loads((tmp_path / "kl" / "world.json").read_text())
    assert world["backend"] == "gloo" and world["devices"] == {"cpu": "gloo"}
    _check_kl(hist)
    assert hist[1]["kl"] > 0 and hist[0]["entropy"] > 0
    # the KL metrics join the engine's, not replace them
    assert all(h["rollout_engine"] == "embedded" for h in hist)


def test_recomputed_old_logprobs_with_the_embedded_engine(tmp_path):
    # algorithm.old_logprobs=recompute: the policy re-scores its episodes (in the TP2 rollout
    # layout) before TRAIN, and the engine's logprobs agree with it within 1e-4 in fp32; with
    # TIS on, the weights pi_old / pi_rollout are then 1 within the same bound, none truncated
    cfg = _cfg(str(tmp_path / "re"), 2, {"old_logprobs": "recompute", "off_policy": "tis"},
               mode="static", rollout="tp2", logprob="tp2", train="dp2")
    hist = run_distributed(_train, 2, cfg, timeout=400)[0]
    for h in hist:
        assert h["rollout_engine"] == "embedded"
        assert 0 <= h["rollout_logprob_diff"] <= h["rollout_logprob_diff_max"] < 1e-4, h
        assert abs(h["off_policy_weight_mean"] - 1) < 1e-4, h
        assert h["off_policy_capped_fraction"] == 0, h
        assert abs(h["advantage_mean"]) < 1e-6  # checked before the weights
    # the weights need the trainer's re-scoring: chosen when old_logprobs is left out, refused
    # when given as the engine's own
    assert TrainConfig.from_dict({"algorithm": {"off_policy": "tis"}}).algorithm.old_logprobs \
        == "recompute"
    with pytest.raises(ConfigError, match="old_logprobs=recompute"):
        TrainConfig.from_dict({"algorithm": {"off_policy": "tis", "old_logprobs": "rollout"}})
    with pytest.raises(ConfigError, match="off_policy_cap=-1"):
        TrainConfig.from_dict({"algorithm": {"off_policy": "tis", "off_policy_cap": -1,
                                             "old_logprobs": "recompute"}})
    with pytest.raises(ConfigError, match="algorithm.old_logprobs='both'"):
        TrainConfig.from_dict({"algorithm": {"old_logprobs": "both"}})


def test_kl_in_the_reward_with_auto_layouts(tmp_path):
    # no group cache: the policy and the reference are rebuilt by same-layout switches
    cfg = _cfg(str(tmp_path / "klr"), 3, {"kl_mode": "reward", "kl_coef": 0.1},
               {"group_cache_layouts": 1}, mode="auto")
    hist = run_distributed(_train, 2, cfg, timeout=400)[0]
    assert set(hist[0]["layouts"]) == {"rollout", "logprob", "train"}
    assert "logprob" in hist[0]["predicted_memory_gb"]
    _check_kl(hist)
    assert "entropy" not in hist[0]


def test_auto_layouts_change_under_a_memory_budget(tmp_path):
    # 0.02 GB per rank: TRAIN in DP2 without recompute (the whole model's activations per rank,
    # ~24 MiB predicted) no longer fits, so TRAIN either moves to a layout that splits them (CP2
    # or TP2) or, layout.recompute=auto (default), keeps DP2 with recomputation (selective is
    # the cheapest here), while ROLLOUT (a few MiB) keeps DP2: every stage in budget, and each
    # iteration's record says which mode TRAIN ran with, and why
    cfg = _cfg(str(tmp_path / "auto"), 2, mode="auto", memory_budget_gb=0.02)
    hist = run_distributed(_train, 2, cfg, timeout=400)[0]
    assert len(hist) == 2
    for h in hist:
        lay, mode = h["layouts"], h["recompute"]["train"]
        assert set(h["recompute"]) == {"train"} and mode in ("none", "selective", "full")
        assert lay["train"] != "DP2" or mode != "none", h["layout_reasons"]
        assert lay["rollout"] == "DP2", h["layout_reasons"]
        assert all(0 < gb <= 0.02 for gb in h["predicted_memory_gb"].values()), h
        assert f"recompute={mode} (" in h["layout_reasons"]["train"], h["layout_reasons"]


def test_evaluation_after_a_cp_train_layout(tmp_path):
    # the engine decodes with cp=1: the end-of-run evaluation must still happen after CP2
    cfg = _cfg(str(tmp_path / "cp"), 1, mode="static", rollout="dp2", logprob="dp2", train="cp2")
    hist = run_distributed(_train, 2, cfg, timeout=400)[0]
    assert hist[0]["layouts"]["train"] == "CP2"
    evals = json.loads((tmp_path / "cp" / "eval.json").read_text())
    assert "random/sampled" in evals["end"]
    # rank 0's rollout replica (DP2: 2 of the 4 episodes) wrote them decoded (trainer/samples.py)
    from earl_megatron.trainer.samples import read_samples
    rows = read_samples(tmp_path / "cp", 0)
    assert len(rows) == 2 and {r["sample"] for r in rows} < set(range(4))
    for r in rows:
        assert "".join(s["text"] for s in r["segments"]) == r["text"] and r["turns"] >= 1
        assert [s["trained"] for s in r["segments"]][:2] == [False, True]  # prompt, then a move
        assert r["finish_reason"] in ("done", "max_turns", "max_context")


def test_zero_iterations_evaluate_the_starting_policy_and_stop(tmp_path):
    # run.iterations=0 (verl's val_only): the start evaluation is the whole run
    out = tmp_path / "ev"
    assert run_distributed(_train, 2, _cfg(str(out), 0), timeout=400)[0] == []
    evals = json.loads((out / "eval.json").read_text())
    assert set(evals) == {"start"} and "random/greedy" in evals["start"]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    assert not list(out.glob("checkpoints/iter_*"))


def test_pipeline_train_layout_with_length_grouped_micro_batches(tmp_path):
    # micro-batches of different lengths and rows cross the pipeline (variable_seq_lengths)
    cfg = _cfg(str(tmp_path / "pp"), 1, mode="static", rollout="dp2", logprob="dp2", train="pp2")
    hist = run_distributed(_train, 2, cfg, timeout=400)[0]
    assert hist[0]["layouts"]["train"] == "PP2" and hist[0]["loss"] == hist[0]["loss"]


def _bad(cfg):
    from earl_megatron.plan.selector import LayoutOverBudgetError, NoLayoutFitsError
    from earl_megatron.train import run
    try:
        run(cfg)
    except (ConfigError, LayoutOverBudgetError, NoLayoutFitsError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _reported(cfg):
    """What the command line does with cfg: (exit status, this rank's stderr)."""
    import contextlib
    import io

    from earl_megatron.train import reporting_errors, run
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            reporting_errors(run, cfg)
    except SystemExit as e:
        return e.code, err.getvalue()
    return 0, err.getvalue()


def _bad_each(cfgs, reported=()):
    return [_bad(c) for c in cfgs] + [_reported(c) for c in reported]


def _mistral(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    return str(path)


def test_bad_config_and_layouts_over_budget_stop_before_training(tmp_path):
    with pytest.raises(ConfigError, match="unknown key"):
        TrainConfig.from_dict({"algorithm": {"lrr": 1.0}})
    with pytest.raises(ConfigError, match="layout.mode=static needs"):
        TrainConfig.from_dict({"layout": {"mode": "static", "train": "tp2"}})
    with pytest.raises(ConfigError, match="cluster.group_cache_layouts=-1"):
        TrainConfig.from_dict({"cluster": {"group_cache_layouts": -1}})
    # one launch for every case (each launch costs ~10 s of process start and imports)
    import sys
    sglang = ((None, "needs rollout.sglang_python"),
              (str(tmp_path / "no-venv" / "python"), "is not an executable file"),
              (sys.executable, "cannot import sglang"))
    cfgs = [TrainConfig.from_dict({"env": {"name": "chess"},
                                   "run": {"output_dir": str(tmp_path / "x")}}),
            TrainConfig.from_dict({
                "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp4"},
                "run": {"output_dir": str(tmp_path / "y")}}),
            TrainConfig.from_dict({"cluster": {"nodes": 2},
                                   "run": {"output_dir": str(tmp_path / "z")}}),
            # layouts over the memory budget
            _cfg(str(tmp_path / "s"), 2, mode="static", rollout="dp2", logprob="dp2",
                 train="dp2", memory_budget_gb=0.0005),
            _cfg(str(tmp_path / "a"), 2, mode="auto", memory_budget_gb=0.0005)]
    # a missing or broken SGLang python stops every rank before any model or server exists
    cfgs += [TrainConfig.from_dict({"rollout": {"engine": "sglang", "sglang_python": python},
                                    "run": {"output_dir": str(tmp_path / f"sg{i}")}})
             for i, (python, _) in enumerate(sglang)]
    # the command line's handling (train.reporting_errors) of input files that used to print a
    # traceback on every rank: one line from rank 0, nothing from the others, exit 2 on both
    out = {k: str(tmp_path / f"r_{k}") for k in ("data", "tok", "arch", "neither", "fits")}
    reported = {
        "data": ({"sft": {"steps": 1, "batch_size": 1, "data": str(tmp_path / "none.jsonl")}},
                 f"configuration error: sft.data={tmp_path}/none.jsonl is not a file; point "
                 "sft.data at a JSONL file of chat trajectories (rollout/trajectories.py) or set "
                 "sft.data=null to warm start on the environment's expert"),
        "tok": ({"rollout": {"tokenizer": str(tmp_path / "no-tok")}},
                f"configuration error: rollout.tokenizer={tmp_path}/no-tok is not a directory; "
                "use game, ascii, tool or the model's HF directory"),
        "arch": ({"run": {"init": _mistral(tmp_path / "mistral")}},
                 f"configuration error: run.init={tmp_path}/mistral: architecture "
                 "MistralForCausalLM is not supported; supported: ['LlamaForCausalLM', "
                 "'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'] (decoder-only"),
        "neither": ({"run": {"init": str(tmp_path)}},
                    f"checkpoint error: run.init={tmp_path}: {tmp_path} is neither a converted "
                    "Megatron-Core checkpoint"),
        "fits": ({"layout": {"mode": "auto", "memory_budget_gb": 0.0005}},
                 "layout error: no layout fits stage rollout"),
    }
    rcfgs = [TrainConfig.from_dict({**o, "run": {**o.get("run", {}), "output_dir": out[k]}})
             for k, (o, _) in reported.items()]
    per_rank = run_distributed(_bad_each, 2, cfgs, rcfgs, timeout=240)
    for (k, (_, says)), r0, r1 in zip(reported.items(), per_rank[0][len(cfgs):],
                                      per_rank[1][len(cfgs):], strict=True):
        assert r0[0] == r1[0] == 2 and r1[1] == "", (k, r0, r1)
        lines = r0[1].splitlines()
        assert len(lines) == 1 and lines[0].startswith(says), (k, r0)
        assert k == "fits" or not (tmp_path / f"r_{k}").exists()  # stopped before any write
    per_rank = [r[:len(cfgs)] for r in per_rank]
    chess, tp4, nodes, static, auto, *sg = zip(*per_rank)  # each: every rank's message
    assert static[0].startswith("LayoutOverBudgetError: static layout DP2 for stage rollout")
    assert "use layout=auto" in static[0]
    assert auto[0].startswith("NoLayoutFitsError: no layout fits stage rollout")
    assert not (tmp_path / "s" / "metrics.jsonl").exists()
    assert chess[0].startswith("ConfigError: env.name='chess': unknown environment 'chess'")
    assert "layout.train=tp4" in tp4[0] and "world size 2" in tp4[0]
    assert "cluster.nodes=2" in nodes[0]
    for i, ((_, says), msgs) in enumerate(zip(sglang, sg, strict=True)):
        assert all(m.startswith("ConfigError") and says in m and "EARL_SGLANG_PYTHON" in m
                   and "make sglang" in m for m in msgs), msgs
        out = tmp_path / f"sg{i}"
        assert not (out / "checkpoints").exists() and not (out / "sglang").exists()
    with pytest.raises(ConfigError, match="run.iterations=-1 must be >= 0"):
        TrainConfig.from_dict({"run": {"iterations": -1}})
    with pytest.raises(ConfigError, match="rollout.top_p"):
        TrainConfig.from_dict({"rollout": {"top_p": 0.0}})


def test_command_line_bad_input_is_one_line_and_exit_2(tmp_path):
    # the whole command line (Hydra, main, run): run.init of an architecture the project does
    # not convert used to be a traceback raised while the Trainer was built; now validate names
    # it. Torch's own C++ log lines ("[rank0]:[W...") are not the trainer's output.
    import os
    import subprocess
    import sys

    init = _mistral(tmp_path / "mistral")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "earl_megatron.train", f"run.init={init}",
                           f"run.output_dir={tmp_path / 'out'}"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l and not l.startswith("[rank")]
    assert lines == [f"configuration error: run.init={init}: architecture MistralForCausalLM is "
                     "not supported; supported: ['LlamaForCausalLM', 'Qwen2ForCausalLM', "
                     "'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'] (decoder-only, RMSNorm, SwiGLU, "
                     "default rope, no sliding window; mixture of experts as Qwen3-MoE only: "
                     "docs/conversion.md)"], proc.stderr[-3000:]
    assert not (tmp_path / "out" / "resolved.json").exists()
