"""``env.name=agent``'s configuration is checked before any worker starts (train.validate):
each problem one ConfigError naming the key and the fix."""

import pytest

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.train import validate

ENTRY = "earl_megatron.testing.agents:probe"


def _check(tmp_path, kwargs=None, world=1, **sections):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"kind": "plain"}\n')
    env = {"name": "agent", "eval_opponents": [],
           "kwargs": {"entry": ENTRY, "tasks": str(tasks)} if kwargs is None else kwargs}
    env.update(sections.pop("env", {}))
    validate(TrainConfig.from_dict({"env": env, **sections}), world)


def test_a_valid_agent_config_passes(tmp_path):
    _check(tmp_path)


@pytest.mark.parametrize("kwargs,match", [
    ({"entry": ENTRY}, "env.kwargs.tasks=PATH"),
    ({"entry": ENTRY, "tasks": "/no/such.jsonl"}, "no such file"),
    ({"tasks": "T"}, "env.kwargs.reward"),                       # built-in agent, no reward
    ({"entry": "no_such_module_q:f", "tasks": "T"}, "cannot import"),
    ({"entry": ENTRY, "tasks": "T", "reward": "json:nope"}, "has no 'nope'"),
    ({"entry": ENTRY, "tasks": "T", "opponent": "random"}, "reads entry, tasks and reward"),
])
def test_bad_agent_kwargs_name_the_key(tmp_path, kwargs, match):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"kind": "plain"}\n')
    kwargs = {k: (str(tasks) if v == "T" else v) for k, v in kwargs.items()}
    with pytest.raises(ConfigError, match=match):
        _check(tmp_path, kwargs)


def test_opponents_warm_start_and_moe_rollouts_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"env.eval_opponents=\['random'\]"):
        _check(tmp_path, env={"eval_opponents": ["random"]})
    with pytest.raises(ConfigError, match="sft.data=PATH"):
        _check(tmp_path, sft={"steps": 4})
    moe = {"family": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 32,
           "moe_router_topk": 2}
    _check(tmp_path, model=moe)   # auto layouts: the planner keeps rollouts at ep = 1
    with pytest.raises(ConfigError, match="ep=1"):
        _check(tmp_path, model=moe, world=2, layout={
            "mode": "static", "rollout": "ep2", "logprob": "dp2", "train": "dp2"})
    _check(tmp_path, model=moe, layout={"mode": "static", "rollout": "dp1", "logprob": "dp1",
                                        "train": "dp1"})


def test_agent_programs_on_moe_plan_ep1_rollouts_themselves():
    """Auto layouts for agent programs on an MoE model (embedded engine): every ROLLOUT
    candidate the selector weighs has ep = 1, while TRAIN may still use expert parallelism."""
    from earl_megatron.plan.specs import Stage
    from earl_megatron.trainer.planner import StagePlanner
    from earl_megatron.trainer.agent_rollout import agent_programs_on_moe
    from earl_megatron.trainer.stages import BatchShape

    cfg = TrainConfig.from_dict({
        "model": {"family": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 32,
                  "moe_router_topk": 2},
        "env": {"name": "agent", "eval_opponents": [], "kwargs": {"entry": ENTRY,
                                                                 "tasks": "t.jsonl"}}})
    assert agent_programs_on_moe(cfg)

    def planner(cap):
        return StagePlanner(cfg.model, cfg.layout, cfg.cluster, 4, distributed_optimizer=False,
                            episodes=8, batch=BatchShape(2, None), rollout_max_ep=cap)

    free = planner(None).selector.valid_layouts(Stage.ROLLOUT)
    capped = planner(1).selector.valid_layouts(Stage.ROLLOUT)
    assert any(lay.ep > 1 for lay in free)
    assert capped and all(lay.ep == 1 for lay in capped)
    assert set(capped) == {lay for lay in free if lay.ep == 1}
    assert any(lay.ep > 1 for lay in planner(1).selector.valid_layouts(Stage.TRAIN))
    assert planner(1).plan("rollout", [64] * 8, None).ep == 1
