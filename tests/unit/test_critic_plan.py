"""PPO's critic in the planners: plan/critic_memory.py counts and places it once for both the
trainer (trainer/planner.py) and ``earl plan --critic`` (tools/plan_layouts.py)."""

import io

import pytest
from test_plan_layouts_cli import tool  # noqa: F401 - the fixture loading tools/plan_layouts.py

from earl_megatron.plan.critic_memory import train_bytes, weight_bytes
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import train_state_bytes
from earl_megatron.plan.specs import Stage, TrainOptions
from earl_megatron.plan.tensor_table import num_parameters
from earl_megatron.testing.configs import tiny_connect_four


def test_the_tool_places_and_counts_the_critic_as_the_trainer_does(tmp_path, tool):
    from earl_megatron.trainer.planner import StagePlanner
    from earl_megatron.trainer.stages import BatchShape

    cfg = tiny_connect_four(str(tmp_path), algorithm={"name": "ppo"},
                            layout={"mode": "auto", "memory_budget_gb": 0.015})
    p = StagePlanner(cfg.model, cfg.layout, cfg.cluster, 2, distributed_optimizer=False,
                     episodes=8, batch=BatchShape(1))
    opts = p.selector.train_opts
    one = ParallelLayout.parse("dp2", world_size=2, model=cfg.model)
    # a whole replica per rank: every parameter (the tiny model is fp32: 4 bytes each, 152,128
    # parameters), then its grads and Adam state on top
    assert weight_bytes(cfg.model, one, opts) == num_parameters(cfg.model) * 4 == 608_512
    assert train_bytes(cfg.model, one, opts) == 608_512 + train_state_bytes(cfg.model, one, opts)
    assert p.train_bytes(one) == train_bytes(cfg.model, one, opts)

    chosen = tool.critic_choice(p.selector, 8)            # the tool's: 8 episodes of 128 tokens
    assert chosen.layout == p.critic_choice()
    first = p.selector.plan(tool.StageWorkload.of(Stage.TRAIN, 128, 8,
                                                  micro_batch_tokens=128))[0].layout
    assert chosen.chosen.memory.resident == p.train_bytes(first) > 0


def test_earl_plan_critic_on_the_7b_node(tool):
    argv = ["--model", "qwen2.5-7b", "--contexts", "1024,32768", "--responses", "64",
            "--micro-batch-tokens", "16384", "--stages", "train"]
    args = tool.build_parser().parse_args(argv)
    model = tool.model_from_args(args)
    out = io.StringIO()
    assert tool.main(argv + ["--critic"], out=out) == 0
    text = out.getvalue()
    assert "; ppo: a critic of the policy's shape" in " ".join(text.split())  # (wrapped)
    assert "train, ppo (64 sequences per context)" in text
    assert text.count(" policy: train ") == 2 and text.count(" critic: train ") == 2

    opts = TrainOptions(distributed_optimizer=True)
    selector = tool.Selector(model, tool.cluster_from_args(args), opts,
                             tool.SelectorConfig(auto_recompute=True))
    critic = tool.critic_choice(selector, 64).layout
    state = train_bytes(model, critic, opts)
    for critic_on, resident in ((False, 0), (True, state)):
        grid = tool.plan_grid(selector, [Stage.TRAIN], [1024], [64], 16384, critic=critic_on)
        assert grid[(Stage.TRAIN, 1024, 64)].chosen.memory.resident == resident

    rows = tool.critic_rows(model, args, opts, selector.config, 64)
    # docs/algorithms.md: the 7B trains on 4 GPUs alone, on the node's 8 with a critic
    assert [r["alone_fewest"][0] for r in rows] == [4, 4]
    assert [r["with_fewest"][0] for r in rows] == [8, 8]
    assert rows[0]["with"]["critic"].layout == critic and rows[0]["with"]["resident"] == state

    with pytest.raises(SystemExit, match="ppo_problem"):
        tool.main(["--critic", "--lora-rank", "8"], out=io.StringIO())
