"""Every Hydra recipe composes and converts to a TrainConfig (every key a dataclass field)."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from earl_megatron.config.train import TrainConfig
from earl_megatron.train import RECIPES


def _load(name: str, overrides=()) -> TrainConfig:
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        cfg = compose(config_name=name, overrides=list(overrides))
    return TrainConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def test_cpu_default():
    cfg = _load("config")
    assert cfg.model.num_layers == 4 and cfg.layout.mode == "auto"
    assert cfg.rollout.engine == "embedded" and cfg.env.name == "connect_four"


@pytest.mark.parametrize("override", ["algorithm=grpo", "algorithm=ppo", "env=calculator",
                                      "layout=static", "rollout=sglang", "cluster=h100",
                                      "model=qwen2.5-7b"])
def test_every_group_option(override):
    extra = ["algorithm.group_size=4"] if override == "algorithm=grpo" else []
    _load("config", [override, *extra])


@pytest.mark.parametrize("name, nodes, layers", [("qwen2.5-7b", 1, 28), ("qwen2.5-72b", 16, 80)])
def test_gpu_recipes(name, nodes, layers):
    cfg = _load(name, ["run.init=/ckpt/hf"])
    assert cfg.cluster.nodes == nodes and cfg.model.num_layers == layers
    assert cfg.rollout.engine == "sglang" and cfg.rollout.tokenizer == "/ckpt/hf"
    assert cfg.algorithm.use_distributed_optimizer and cfg.algorithm.lr <= 1e-6


def test_tool_use_recipe():
    from earl_megatron.train import make_tokenizer

    cfg = _load("tool_use")
    assert cfg.env.name == "calculator" and cfg.rollout.tokenizer == "tool"
    assert cfg.sft.steps > 0 and cfg.sft.data is None and cfg.algorithm.kl_mode == "off"
    assert len(make_tokenizer(cfg)) == cfg.model.vocab_size == 64
    # the environment takes every kwarg the recipe gives it
    from earl_megatron.envs import make_env
    make_env(cfg.env.name, **cfg.env.kwargs).expert(0)
    with pytest.raises(Exception, match="kl_mode"):
        _load("tool_use", ["algorithm.kl_mode=loss", "algorithm.kl_coef=0.1"])
