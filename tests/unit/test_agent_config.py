"""``env.name=agent``'s configuration is checked before any worker starts (train.validate):
each problem one ConfigError naming the key and the fix."""

import pytest

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.train import validate

ENTRY = "earl_megatron.testing.agents:probe"


def _check(tmp_path, kwargs=None, **sections):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"kind": "plain"}\n')
    env = {"name": "agent", "eval_opponents": [],
           "kwargs": {"entry": ENTRY, "tasks": str(tasks)} if kwargs is None else kwargs}
    env.update(sections.pop("env", {}))
    validate(TrainConfig.from_dict({"env": env, **sections}), 1)


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
    with pytest.raises(ConfigError, match="ep=1"):
        _check(tmp_path, model=moe)
    _check(tmp_path, model=moe, layout={"mode": "static", "rollout": "dp1", "logprob": "dp1",
                                        "train": "dp1"})
