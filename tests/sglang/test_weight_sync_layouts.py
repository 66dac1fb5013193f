"""The weight plan in the trainer, on real CPU servers (opt-in: EARL_SGLANG_VENV).

One 4-rank trainer run of 3 iterations with static layouts: rollout TP2xDP2 (two tp2 servers,
leaders 0 and 2), train PP2xDP2:

    train PP2xDP2   ranks 0, 1 pp_stage 0 | 2, 3 pp_stage 1   leader 0 gets stage 1 from 2 or 3,
                                                                leader 2 stage 0 from 0 or 1

A tp2 server's leader fed from a train layout split by tp (it holds tp0 and gets tp1) is
tests/sglang/test_sglang_layout_change.py's TP2 play; dp servers fed from a tp2 train layout are
test_trainer_sglang.py's. (This file ran a second, TP2xDP2, trainer run of that case until
2026-12-06: two more server starts for a push those two tests check.)

The run plays agent programs (``env.name=agent``, earl_megatron/testing/agents.py ``probe``: the
``openai`` client through the endpoint at each server's leader, whose calls the SGLang server
batches; one agent forks its episode, one posts its reward), so the endpoint's rows, forks
included, are what the servers sampled and the trainer re-scores.

Checked on every iteration's metrics line: ``rollout_logprob_diff_max`` < 1e-4 (the servers hold
the trainer's weights, pushed from the train layout, the first rollout's included), ranks 1
and 3 received no byte of weights (``weight_sync_bytes_in_max`` == 0), and the busiest leader
received exactly what it lacks (``plan/weight_plan.minimum_recv_bytes``), less than the
model's bytes (``rollout_push_bytes``, what a leader pushes); ``weight_sync_s`` > 0.
"""

from __future__ import annotations

import json

import pytest

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed

pytestmark = pytest.mark.timeout(2400)  # server starts take minutes on 2 busy cores

TRAIN_LAYOUTS = ("pp2xdp2",)


def _runs(cfgs):
    from earl_megatron.train import run
    return [run(cfg) for cfg in cfgs]


AGENT_KINDS = ("plain", "fork", "post", "plain")


def _cfg(sglang_python: str, train: str, out) -> TrainConfig:
    env = {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1}}
    if train == "pp2xdp2":
        tasks = out.parent / "agent_tasks.jsonl"
        tasks.write_text("".join(json.dumps({"kind": k, "prompt": "play"}) + "\n"
                                 for k in AGENT_KINDS))
        env = {"name": "agent", "eval_opponents": [],
               "kwargs": {"entry": "earl_megatron.testing.agents:probe", "tasks": str(tasks)}}
    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "tp2xdp2", "logprob": "tp2xdp2",
                   "train": train},
        "env": env,
        "rollout": {"engine": "sglang", "sglang_python": sglang_python,
                    "sglang_device": "cpu", "episodes_per_iteration": 4, "max_turns": 3,
                    "sglang_bucket_mb": 0.1},
        "algorithm": {"micro_batch_size": 2},
        "cluster": {"collective_timeout_s": 900, "server_start_timeout_s": 300,
                    "server_request_timeout_s": 60, "weight_sync_timeout_s": 45,
                    "server_max_restarts": 2},
        "run": {"iterations": 3, "output_dir": str(out), "checkpoint_every": 0,
                "live_view": False, "eval_episodes": 2},
    })


def test_a_pipeline_train_layout_pushes_only_to_the_leaders(sglang_python, run_dir):
    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.tensor_table import num_parameters
    from earl_megatron.plan.weight_plan import minimum_recv_bytes

    cfgs = [_cfg(sglang_python, t, run_dir / t) for t in TRAIN_LAYOUTS]
    run_distributed(_runs, 4, cfgs, timeout=2100, collective_timeout_s=900)
    model = ModelConfig.tiny(vocab_size=32)
    for train in TRAIN_LAYOUTS:
        lines = [json.loads(x) for x in (run_dir / train / "metrics.jsonl").read_text()
                 .splitlines() if x.strip()]
        lines = [x for x in lines if "iteration" in x]
        keys = ("iteration", "rollout_logprob_diff_max", "weight_sync_bytes_in_max",
                "weight_sync_bytes_in_leader", "weight_sync_s", "rollout_push_bytes")
        print(train, json.dumps([{k: x.get(k) for k in keys} for x in lines]))
        assert [x["iteration"] for x in lines] == [0, 1, 2]
        lay = ParallelLayout.parse(train, world_size=4, model=model)
        lack = max(minimum_recv_bytes(model, lay, r) for r in (0, 2))
        for x in lines:
            assert x["layouts"]["train"] == str(lay) and x["layouts"]["rollout"] == "TP2xDP2"
            assert x["rollout_logprob_diff_max"] < 1e-4, x
            assert x["weight_sync_bytes_in_max"] == 0, x
            assert x["weight_sync_bytes_in_leader"] == lack > 0, (x, lack)
            assert lack < x["rollout_push_bytes"] == 4 * num_parameters(model), x
            assert x["weight_sync_s"] > 0
            if train == "pp2xdp2":  # the agents: plain 1 call, fork 2, post 1, plain 1
                assert x["agent_calls_per_episode"] == 5 / 4 and x["agent_forks"] == 1, x
                assert x["agent_errors"] == x["agent_timeouts"] == 0, x
        versions = [int(x["rollout_weight_version"].removeprefix("it")) for x in lines]
        assert versions == list(range(versions[0], versions[0] + 3))  # one push per TRAIN step
