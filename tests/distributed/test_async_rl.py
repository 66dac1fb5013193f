"""Asynchronous RL on 2 ranks (algorithm.max_staleness >= 1, trainer/episode_pool.py).

- An episode interrupted at a turn boundary and continued in another layout (re-prefilled)
  equals the uninterrupted one at the same weights: greedy, the embedded engine, the same
  tokens, logprobs within fp32 rounding, each token keeping the version that sampled it.
- A k=1 run: episodes carry over, the trained tokens are at most 1 version old (and some are),
  GRPO groups train whole, nothing is dropped (a group at the bound is waited for), decoupled
  PPO's weights are recorded.
- k=2 (live episodes at every checkpoint): a stop request during a rollout, then SIGKILL between
  iterations with episodes in flight; the relaunches' metrics equal an uninterrupted run's line
  for line (the pool is in the checkpoint; its episodes' environments are rebuilt by replay).
"""

import json

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import kill_torchrun, run_distributed



def _continuation():
    from earl_megatron.runtime.cpu_backend import cpu_backend

    with cpu_backend():
        return _continue_in_another_layout()


def _continue_in_another_layout():
    import torch.distributed as dist

    from earl_megatron.runtime import groups

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.envs import make_env
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.agent_loop import (AgentLoopConfig, LiveEpisode, play_turns,
                                                  replay_env, start_episode)
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.rollout.tokenizer import chat_format, char_tokenizer
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.testing.weights import biased_weights

    tok = char_tokenizer()
    end, three = chat_format(tok).stop_token_ids[0], tok.convert_tokens_to_ids("3")
    cfg = ModelConfig.tiny("llama")
    weights = biased_weights(cfg, {three: 5.0, end: 4.8})
    world = dist.get_world_size()
    tp2 = build_on_layout(cfg, ParallelLayout.parse("tp2", world_size=world, model=cfg),
                          weights=weights, ddp=False)
    loop = AgentLoopConfig(max_turns=6, max_action_tokens=4, temperature=0.0)
    seeds = [0, 1, 2, 3]

    def fresh():
        return [start_episode(make_env("connect_four"), s, tok, loop, key=s) for s in seeds]

    whole, rest = play_turns(EmbeddedEngine(tp2), fresh(), tok, loop)
    assert not rest
    turns = iter(range(100))
    first, live = play_turns(EmbeddedEngine(tp2), fresh(), tok, loop,
                             enough=lambda f: next(turns) >= 2)   # two turns, then stop
    assert live, "every episode ended within two turns: nothing to continue"
    groups.destroy_groups()
    # the live episodes travel as data and continue on another layout under "version 1"
    moved = [LiveEpisode(env=replay_env(make_env("connect_four"), e.seed, e.actions),
                         **e.data()) for e in live]
    dp2 = build_on_layout(cfg, ParallelLayout.parse("dp2", world_size=world, model=cfg),
                          weights=weights, ddp=False)
    later, left = play_turns(EmbeddedEngine(dp2, prompts="replica"), moved, tok, loop,
                             version=1)
    assert not left
    return ({k: (e.token_ids, e.logprobs, e.reward, e.finish_reason) for k, e in whole},
            {k: (e.token_ids, e.logprobs, e.reward, e.finish_reason, e.versions)
             for k, e in first + later}, [e.key for e in live])


def test_a_continued_episode_equals_an_uninterrupted_one():
    whole, parts, moved = run_distributed(_continuation, 2, timeout=300)[0]
    assert sorted(whole) == sorted(parts)
    for k, (tokens, logprobs, reward, why) in whole.items():
        got = parts[k]
        assert got[0] == tokens and got[2:4] == (reward, why), k
        assert max(abs(a - b) for a, b in zip(got[1], logprobs)) < 1e-4, k
        versions = got[4]
        sampled = [v for v, lp in zip(versions, got[1]) if v >= 0]
        if k in moved:   # two turns at version 0, the rest at version 1
            assert 0 in sampled and 1 in sampled, (k, versions)
            assert sampled == sorted(sampled)
        else:
            assert set(sampled) == {0}


def _cfg(out, iterations, **algorithm):
    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp2"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": []},
        "rollout": {"episodes_per_iteration": 4, "max_turns": 4},
        "algorithm": {"micro_batch_size": 2, "old_logprobs": "recompute",
                      "off_policy": "decoupled", "max_staleness": 1, **algorithm},
        "run": {"iterations": iterations, "output_dir": out, "checkpoint_every": 1,
                "eval_episodes": 2, "live_view": False},
    })


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def test_k1_run_carries_episodes_within_the_bound(tmp_path):
    hist = run_distributed(_train, 2, _cfg(str(tmp_path / "k1"), 4, name="grpo", group_size=2),
                           timeout=400)[0]
    assert [h["pool_admitted"] for h in hist][0] == 8     # (k + 1) batches at the start
    assert all(h["staleness_max"] <= 1 for h in hist)
    assert any(h["staleness_mean"] > 0 for h in hist), [h["staleness_shares"] for h in hist]
    assert any(h["pool_carried"] > 0 for h in hist)
    for h in hist:
        assert abs(sum(h["staleness_shares"].values()) - 1) < 1e-9
        assert "off_policy_weight_mean" in h and 0 <= h["off_policy_capped_fraction"] <= 1
        # the engine against the re-scoring, on the tokens the current weights sampled
        assert h["rollout_logprob_diff_max"] < 1e-4, h
        assert h["pool_carried"] + h["pool_admitted"] <= 8  # never past (k + 1) batches
        assert h["pool_dropped"] == 0   # a group at the bound is waited for, never dropped


ASYNC_RUN = ["model.vocab_size=32", "layout=static", "layout.rollout=dp2", "layout.logprob=dp2",
             "layout.train=tp2", "env.eval_opponents=[]", "rollout.episodes_per_iteration=4",
             "rollout.max_turns=4", "algorithm.micro_batch_size=2",
             "algorithm.old_logprobs=recompute", "algorithm.off_policy=decoupled",
             "algorithm.max_staleness=2", "run.iterations=4", "run.eval_episodes=2",
             "run.live_view=false"]


def _launch(out, *extra, checkpoint_every=1):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("EARL_STOP_FILE", None)   # the default: <run>/stop
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "-m", "earl_megatron.train",
                             f"run.output_dir={out}", f"run.checkpoint_every={checkpoint_every}",
                             *ASYNC_RUN, *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _wait(proc, ready, timeout=400):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended early: {proc.stderr.read().decode()[-3000:]}"
    raise AssertionError(f"not ready within {timeout} s")


def _lines(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_stop_and_sigkill_with_episodes_in_flight_then_resume(tmp_path):
    """k=2, Connect Four held from a chosen iteration's rollout on (earl_megatron/testing/envs.py:
    its steps wait once metrics.jsonl has so many lines, so where each event lands does not
    depend on the machine's speed):

    1. a stop request while iteration 2's rollout holds, no periodic checkpoint: the stage is
       abandoned, the pool rewinds to what it was before it (episodes of iterations 0 and 1,
       some live), checkpoint 1 holds that;
    2. the relaunch (checkpoint_every=1) replays iteration 2, checkpoints it with episodes in
       flight, holds in iteration 3's rollout and is killed with SIGKILL;
    3. the last relaunch resumes from checkpoint 2, rebuilding the live episodes' environments
       by replay.
    The metrics, line for line, equal an uninterrupted run's."""
    out = tmp_path / "run"
    held = ["env.name=earl_megatron.testing.envs:held_connect_four",
            f"+env.kwargs.hold_when={out / 'metrics.jsonl'}"]
    proc = _launch(out, *held, "+env.kwargs.hold_lines=2", checkpoint_every=0)
    _wait(proc, lambda: (out / "metrics.jsonl").exists() and len(_lines(out)) >= 2)
    (out / "stop").write_text("requested\n")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert (out / "stop").read_text() == "stopped 1\n"
    loop = json.loads((out / "checkpoints" / "iter_000001" / "loop.json").read_text())
    keys = [e["key"] for e in loop["pool"]["entries"]]
    assert keys and all(k[0] <= 1 for k in keys), keys   # nothing iteration 2 started
    assert any(e["live"] is not None for e in loop["pool"]["entries"])

    ckpt = out / "checkpoints" / "iter_000002" / "loop.json"
    proc = _launch(out, *held, "+env.kwargs.hold_lines=3", checkpoint_every=1)
    _wait(proc, ckpt.exists)   # published whole (renamed into place); iteration 3 then holds
    kill_torchrun(proc)
    assert len(_lines(out)) == 3
    loop = json.loads(ckpt.read_text())
    live = [e for e in loop["pool"]["entries"] if e["live"] is not None]
    assert loop["iteration"] == 2 and live, "no episode was in flight at the checkpoint"
    assert all(max(e["live"]["versions"]) <= 2 for e in live)

    proc = _launch(out, checkpoint_every=1)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err.decode()[-3000:]
    resolved = json.loads((out / "resolved.json").read_text())
    resolved["run"]["output_dir"] = str(tmp_path / "full")
    full = run_distributed(_train, 2, TrainConfig.from_dict(resolved), timeout=400)[0]
    strip = [{k: v for k, v in h.items() if k != "seconds"} for h in full]
    assert [h["iteration"] for h in _lines(out)] == [0, 1, 2, 3]
    assert [{k: v for k, v in h.items() if k != "seconds"} for h in _lines(out)] == strip
    assert any(h["staleness_max"] >= 1 for h in full[1:])
