"""Every Hydra recipe composes and converts to a TrainConfig (every key a dataclass field)."""

import dataclasses
import pathlib

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


@pytest.mark.parametrize("override", ["algorithm=grpo", "algorithm=reinforce_pp_multi_epoch", "env=calculator",
                                      "env=reasoning_gym", "env=textarena", "layout=static",
                                      "rollout=sglang", "cluster=h100", "model=qwen2.5-7b",
                                      "model=qwen3-8b"])
def test_every_group_option(override):
    """Each option takes effect: every key of its YAML file has that value in the composed
    TrainConfig (unless config.yaml's own section, composed after it, or the command line sets
    the key), and the composition differs from the default in that group."""
    group, option = override.split("=")
    extra = ["algorithm.group_size=4"] if override == "algorithm=grpo" else []
    cfg, default = _load("config", [override, *extra]), _load("config")
    recipes = pathlib.Path(RECIPES)
    own = OmegaConf.load(recipes / "config.yaml").get(group, {})
    file = OmegaConf.load(recipes / group / f"{option}.yaml")
    cli = OmegaConf.from_dotlist(extra).get(group, {})
    want = OmegaConf.to_container(OmegaConf.merge(file, own, cli), resolve=True)
    section = getattr(cfg, group)
    # replace() re-runs the section's validation and canonical form (a kv_channels equal to
    # hidden / heads is stored as None): taking the file's values changes nothing
    want = {k: tuple(v) if isinstance(v, list) else v for k, v in want.items()}
    assert dataclasses.replace(section, **want) == section
    assert section != getattr(default, group)


def test_tiny_model_of_every_family():
    """model.family alone switches the tiny model: the family's qkv bias / q-k norms follow."""
    got = {f: _load("config", [f"model.family={f}"]).model for f in ("llama", "qwen2", "qwen3")}
    assert [(m.add_qkv_bias, m.qk_layernorm) for m in got.values()] == [
        (False, False), (True, False), (False, True)]
    odd = _load("config", ["model.family=qwen3", "model.kv_channels=12"]).model
    assert odd.head_dim == 12 and odd.hidden_size == 64


def test_qwen3_8b_recipe_equals_the_hf_config():
    """recipes/model/qwen3-8b.yaml equals what Qwen/Qwen3-8B's config.json converts to (the
    trainer compares them for run.init) and the planning preset."""
    from earl_megatron.plan.presets import PRESETS
    from earl_megatron.weights.hf_mapping import from_hf_config

    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
          "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
          "max_position_embeddings": 40960, "num_attention_heads": 32, "num_hidden_layers": 36,
          "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_scaling": None,
          "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
          "use_sliding_window": False, "vocab_size": 151936}
    model = _load("qwen3-8b", ["run.init=/ckpt/hf"]).model
    assert model == from_hf_config(hf) == PRESETS["qwen3-8b"]


@pytest.mark.parametrize("name, nodes, layers", [("qwen2.5-7b", 1, 28), ("qwen2.5-72b", 16, 80),
                                                 ("qwen3-8b", 1, 36)])
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
    # a KL after the warm start composes: its reference is the warmed policy
    assert _load("tool_use", ["algorithm.kl_mode=loss",
                              "algorithm.kl_coef=0.1"]).algorithm.kl_mode == "loss"


def test_qwen3_30b_a3b_recipe_is_the_preset_and_its_size():
    """recipes/model/qwen3-30b-a3b.yaml is the planning preset, with Qwen3-30B-A3B's published
    size: 30.5B parameters, 3.3B active (8 of 128 experts)."""
    from earl_megatron.config.compose import compose
    from earl_megatron.config.train import TrainConfig
    from earl_megatron.plan.presets import PRESETS
    from earl_megatron.plan.tensor_table import num_parameters, tensor_table

    model = TrainConfig.from_dict(OmegaConf.to_container(
        compose(["model=qwen3-30b-a3b"]), resolve=True)).model
    assert model == PRESETS["qwen3-30b-a3b"] and model.is_moe
    assert num_parameters(model) == 30_532_122_624
    assert tensor_table(model).active_elements() == 3_353_032_704
    assert tensor_table(model).expert_elements() == 48 * 128 * 3 * 2048 * 768


def test_tiny_model_becomes_a_tiny_moe_with_the_family_alone():
    from earl_megatron.config.compose import compose
    from earl_megatron.config.train import TrainConfig

    def model(*args):
        return TrainConfig.from_dict(OmegaConf.to_container(compose(list(args)),
                                                            resolve=True)).model
    moe = model("model.family=qwen3_moe")
    assert (moe.num_experts, moe.moe_ffn_hidden_size, moe.qk_layernorm) == (4, 32, True)
    assert model().num_experts is None and model("model.family=qwen3").num_experts is None
