"""What a rank would refuse at the warm start's first step, ``train.validate`` refuses first (one
ConfigError naming the key and the fix), so ``earl train`` stops before any rank starts: an
environment without a scripted expert under ``sft.data=null``, an expert that does not finish
its episode, an ``sft.data`` with fewer traces than ``sft.batch_size``
(trainer/warm_start.py ``check_warm_start``), a new run into a folder that holds one."""

import json
import sys

import pytest

from earl_megatron.config.train import ConfigError, TrainConfig

def _validate(sections: dict) -> str:
    from earl_megatron.train import validate
    try:
        validate(TrainConfig.from_dict(sections), 1)
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")


@pytest.mark.parametrize("env", ["connect_four", "tic_tac_toe"])
def test_a_game_without_expert_is_refused_before_any_model(env):
    assert _validate({"env": {"name": env}, "sft": {"steps": 4}}) == (
        f"sft.steps=4 with sft.data=null plays the environment's expert, but {env} has no "
        "scripted expert; give the warm start a JSONL file of chat trajectories "
        "(sft.data=PATH, docs/trainer.md) or set sft.steps=0")
    # no warm start, or traces of its own: nothing to refuse
    assert _validate({"env": {"name": env}}) == "no error"


def test_an_environment_with_an_expert_passes():
    assert _validate({"env": {"name": "calculator", "eval_opponents": []},
                      "sft": {"steps": 4}}) == "no error"


def test_an_expert_that_does_not_finish_its_episode_is_named(tmp_path, monkeypatch):
    # a user's environment (package.module:factory) whose expert stops one action short
    (tmp_path / "short_expert.py").write_text(
        "from earl_megatron.envs.tool_env import CalculatorEnv\n"
        "class Short(CalculatorEnv):\n"
        "    def expert(self, seed):\n"
        "        return super().expert(seed)[:-1]\n"
        "def make(**kw):\n"
        "    return Short(**kw)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "short_expert", raising=False)
    got = _validate({"env": {"name": "short_expert:make", "eval_opponents": []},
                     "sft": {"steps": 1}})
    assert got.startswith("sft.data=null: calculator expert: its ") and got.endswith(
        "do not finish the episode; give sft.data=PATH (chat trajectories) instead, or fix "
        "short_expert:make's expert"), got


def test_sft_data_with_fewer_traces_than_a_batch_is_refused(tmp_path):
    data = tmp_path / "two.jsonl"
    trace = {"messages": [{"role": "user", "content": "compute 1+1"},
                          {"role": "assistant", "content": "<answer>2</answer>"}]}
    data.write_text((json.dumps(trace) + "\n") * 2)
    assert _validate({"sft": {"steps": 4, "data": str(data), "batch_size": 3}}) == (
        f"sft.batch_size=3 but {data} holds 2 trajectories; lower sft.batch_size")
    assert _validate({"sft": {"steps": 4, "data": str(data), "batch_size": 2}}) == "no error"


def test_a_new_run_into_a_folder_holding_one_is_refused(tmp_path):
    # trainer/resume.py refuses it too, but only after every rank has started
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    run = {"output_dir": str(tmp_path), "resume": False}
    assert _validate({"run": run}) == (
        f"run.output_dir={tmp_path} already holds a run (metrics.jsonl) and run.resume=false "
        f"would overwrite it: set run.resume=true to continue that run, choose a new "
        f"run.output_dir, or delete {tmp_path} to start over")
    assert _validate({"run": {**run, "resume": True}}) == "no error"
