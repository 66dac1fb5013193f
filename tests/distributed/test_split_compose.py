"""Capabilities that compose with split placement (issue #43): a warm start before the pools
split, then the KL reference and PPO's critic on the train pool, both from the warmed policy.

One 4-rank run (train pool ranks 0-1 in dp2, rollout pool ranks 2-3 in dp2, the calculator, k =
1, 3 iterations): the warm start runs on the whole world (sft.jsonl, a 4-rank layout), the train
pool's policy and reference load its last checkpoint, and the run trains every episode the
rollout pool sent exactly once (the split audit, tests/distributed/split_audit.py). The KL is
the check that the reference is the warmed policy: iteration 0 trains the first batch on the
warmed weights, where policy and reference are the same weights in the same layout, so its KL
is exactly 0 (the initial policy as reference would give a KL far from 0); later iterations,
after optimizer steps, have a positive one. The critic (algorithm.name=ppo, issue #45) is built
from the warmed policy: its steps are made too small to move fp32 weights (critic.lr 1e-30), so
the critic of the last checkpoint, exported with ``earl convert mcore-to-hf --critic``, has the
trunk of the warm start's last checkpoint exported as a policy, tensor for tensor."""

import json
from pathlib import Path

import torch

from earl_megatron.config.train import TrainConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.testing.multiproc import run_distributed
from split_audit import check_exactly_once, read_audit, train_audited

TRACES = Path(__file__).resolve().parents[1] / "data" / "calculator_traces.jsonl"


def _cfg(out, iterations=3):
    return TrainConfig.from_dict({
        "model": {"vocab_size": 64, "num_attention_heads": 4, "num_query_groups": 2},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "dp2"},
        "env": {"name": "calculator", "kwargs": {"system_prompt": "", "num_operands": 2},
                "eval_opponents": []},
        "rollout": {"tokenizer": "tool", "episodes_per_iteration": 4, "max_turns": 3,
                    "max_action_tokens": 16, "placement": "split", "pool_ranks": 2},
        "algorithm": {"name": "ppo", "critic": {"lr": 1e-30}, "micro_batch_size": 2,
                      "max_staleness": 1, "off_policy": "decoupled",
                      "old_logprobs": "recompute", "kl_mode": "loss", "kl_coef": 0.1},
        "sft": {"steps": 2, "batch_size": 8, "data": str(TRACES), "lr": 1e-2, "log_every": 1},
        "run": {"iterations": iterations, "output_dir": str(out), "checkpoint_every": 0,
                "eval_episodes": 2, "live_view": False},
    })


def test_warm_start_then_split_with_the_warmed_policy_as_kl_reference(tmp_path):
    audit, out = tmp_path / "audit", tmp_path / "run"
    hist = run_distributed(train_audited, 4, _cfg(out), str(audit), timeout=600)[0]
    sft = [json.loads(x) for x in (out / "sft.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sft] == [0, 1]
    # the warm start ran before the pools split: on all 4 ranks
    assert {ParallelLayout.parse(r["layout"]).world_size for r in sft} == {4}, sft
    assert [h["iteration"] for h in hist] == [0, 1, 2]
    assert hist[0]["kl"] == 0.0 and hist[0]["ref_log_ratio_max"] == 0.0, hist[0]
    assert hist[2]["kl"] > 0.0, hist[2]
    assert all(h["staleness_max"] <= 1 for h in hist)
    check_exactly_once(read_audit(audit), 3)
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert "iter_000002" in ckpts and "sft" in ckpts, ckpts
    assert all(h["value_loss"] > 0 for h in hist), hist
    _check_critic_is_the_warmed_policy(out, tmp_path)


def _check_critic_is_the_warmed_policy(out, tmp_path):
    from safetensors.torch import load_file

    from earl_megatron.testing.peft_check import export
    from earl_megatron.trainer.warm_start import warm_start_state

    export(str(out / "checkpoints" / "iter_000002"), str(tmp_path / "critic"), "--critic")
    export(warm_start_state(out)["path"], str(tmp_path / "warmed"))
    critic = load_file(tmp_path / "critic" / "model.safetensors")
    warmed = load_file(tmp_path / "warmed" / "model.safetensors")
    trunk = {k for k in critic if not k.startswith("score.")}
    assert trunk and trunk <= warmed.keys(), sorted(trunk - warmed.keys())
    assert [k for k in trunk if not torch.equal(critic[k], warmed[k])] == []


def test_moe_routing_replay_on_a_split(tmp_path):
    """MoE routing replay on a split (tiny Qwen3-MoE, train pool ranks 0-1 in tp2, rollout
    pool ranks 2-3 in ep2, k = 1): the experts the rollout pool chose cross the meeting with
    their episodes and are replayed by the train pool's re-scoring, so its logprobs equal the
    engine's on the batches no weight change separates from their rollout (iteration 0), and
    every episode sent is trained exactly once."""
    import dataclasses

    from earl_megatron.config.model import ModelConfig
    from split_audit import split_config

    base = split_config(str(tmp_path / "run"), 3, 1).to_dict()
    model = {k: v for k, v in dataclasses.asdict(ModelConfig.tiny("qwen3_moe")).items()
             if k != "vocab_size"}
    base["model"] = {**model, "vocab_size": 32}
    base["layout"] = {"mode": "static", "rollout": "ep2", "logprob": "tp2", "train": "tp2"}
    base["algorithm"]["routing_replay"] = True
    audit = tmp_path / "audit"
    hist = run_distributed(train_audited, 4, TrainConfig.from_dict(base), str(audit),
                           timeout=600)[0]
    assert [h["iteration"] for h in hist] == [0, 1, 2]
    assert hist[0]["rollout_logprob_diff_max"] < 1e-4, hist[0]
    assert all(h["staleness_max"] <= 1 for h in hist)
    check_exactly_once(read_audit(audit), 3)
