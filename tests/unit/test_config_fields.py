"""Every TrainConfig field is a key of every recipe (overridable without '+'); run.init fills the
model and tokenizer from the checkpoint, the command line's model keys checked against it; a
layout that does not fit is one line naming the budget, the need and the config keys to change."""

import dataclasses
import json
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from earl_megatron.config.compose import RECIPES, command_line_keys, compose, split_args
from earl_megatron.config.conversion import config_keys
from earl_megatron.config.model import INIT_MAY_DIFFER, ModelConfig
from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.train import apply_run_init, configure

RECIPE_NAMES = sorted(p.stem for p in Path(RECIPES).glob("*.yaml"))

# SmolLM2-135M-Instruct's config.json (earl_megatron/testing/smollm2.py writes it), as a literal:
# these tests read config.json only, so they need no weights
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "dtype": "float32",
           "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
           "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama",
           "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
           "rms_norm_eps": 9.999999747378752e-06,
           "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
           "tie_word_embeddings": True, "vocab_size": 49152}
SMOLLM2_MODEL = ModelConfig(num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                            num_attention_heads=9, num_query_groups=3, vocab_size=49152,
                            max_position_embeddings=8192, rotary_base=100000.0,
                            norm_epsilon=9.999999747378752e-06, tie_word_embeddings=True)


def _hydra_value(v) -> str:
    """A Python default as a Hydra override value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    if dataclasses.is_dataclass(v):   # a nested section (model.lora)
        return _hydra_value(dataclasses.asdict(v))
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def _every_field_set_to_its_default() -> list[str]:
    defaults = TrainConfig()
    return [f"{section.name}.{f.name}="
            f"{_hydra_value(getattr(getattr(defaults, section.name), f.name))}"
            for section in dataclasses.fields(TrainConfig)
            for f in dataclasses.fields(typing.get_type_hints(TrainConfig)[section.name])
            if f.name in config_keys(typing.get_type_hints(TrainConfig)[section.name])]


def test_an_internal_field_is_not_a_config_key(tmp_path):
    """ModelConfig.value_head is the critic's: at its default (a resolved.json) it passes, set
    it is one line naming why."""
    assert "value_head" not in config_keys(ModelConfig)
    assert TrainConfig.from_dict({"model": {"value_head": False}}).model.value_head is False
    with pytest.raises(ConfigError, match=r"^model.value_head=True is not a config key: the "
                       r"critic's \(algorithm.name=ppo builds one beside the policy\)$"):
        TrainConfig.from_dict({"model": {"value_head": True}})


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_every_field_is_overridable_without_plus_in_every_recipe(recipe):
    overrides = _every_field_set_to_its_default()
    assert {o.split(".")[0] for o in overrides} == {
        "model", "layout", "env", "rollout", "algorithm", "cluster", "run", "sft"}
    # Hydra refuses 'section.key=value' for a key the composed recipe lacks ('+' needed): every
    # key is there, and setting all of them to the dataclasses' defaults gives the defaults
    d = OmegaConf.to_container(compose(["--config-name", recipe, *overrides]), resolve=True)
    cfg, default = TrainConfig.from_dict(d), TrainConfig()
    # (Hydra merges a mapping given for a mapping: env.kwargs={} keeps the recipe's kwargs)
    assert cfg == dataclasses.replace(default, env=dataclasses.replace(
        default.env, kwargs=cfg.env.kwargs))
    # and no recipe carries a key that nothing reads (from_dict refuses those by name); the GPU
    # recipes' rollout.tokenizer is ${run.init}, so they are composed with one
    TrainConfig.from_dict(OmegaConf.to_container(
        compose(["--config-name", recipe, "run.init=/ckpt/hf"]), resolve=True))


def test_unknown_keys_still_fail_by_name():
    with pytest.raises(Exception, match="rollout.tokenizr"):   # Hydra: not in the config
        compose(["rollout.tokenizr=x"])
    d = OmegaConf.to_container(compose(["+rollout.tokenizr=x"]), resolve=True)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['rollout.tokenizr'\]; valid keys "
                                          r"of rollout: \["):
        configure(d, ["+rollout.tokenizr=x"])


def test_command_line_keys():
    assert command_line_keys(["model.num_layers=2", "+rollout.tokenizer=x", "++run.seed=1",
                              "model=tiny", "~run.init"]) == {
        "model.num_layers", "rollout.tokenizer", "run.seed", "model"}


# ------------------------------------------------------------------ run.init
def _hf(path: Path, tokenizer: bool = True, **changes) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**SMOLLM2, **changes}))
    if tokenizer:   # only its presence is read here
        (path / "tokenizer.json").write_text("{}")
    return str(path)


def _run(*args) -> TrainConfig:
    """What the trainer's command line makes of ``args`` (Hydra composition, then configure)."""
    d = OmegaConf.to_container(compose(list(args)), resolve=True)
    return configure(d, split_args(args)[2])


def test_run_init_alone_is_the_model_and_the_tokenizer(tmp_path):
    init = _hf(tmp_path / "smol")
    cfg = _run(f"run.init={init}")
    assert cfg.model == SMOLLM2_MODEL
    assert cfg.model.norm_epsilon == 9.999999747378752e-06   # the stored float32, exactly
    assert cfg.rollout.tokenizer == init and cfg.run.init == init
    # any recipe: its own model and tokenizer ("tool", 64 ids) give way to the checkpoint's
    cfg = _run("--config-name", "tool_use", f"run.init={init}")
    assert cfg.model == SMOLLM2_MODEL and cfg.rollout.tokenizer == init
    assert cfg.env.name == "calculator" and cfg.sft.steps > 0
    # without run.init nothing changes
    assert _run().model == ModelConfig(vocab_size=32)


def test_model_keys_on_the_command_line_are_checked_against_run_init(tmp_path):
    init = _hf(tmp_path / "smol")
    # equal values pass (a typed 1e-5 for the float32 9.999999747378752e-06; head_dim given as
    # kv_channels; the family's qkv bias spelled out) and the checkpoint's exact value is kept
    cfg = _run(f"run.init={init}", "model.norm_epsilon=1e-5", "model.kv_channels=64",
               "model.add_qkv_bias=false", "model.num_layers=30")
    assert cfg.model == SMOLLM2_MODEL
    # a field that may differ takes the command line's value
    assert INIT_MAY_DIFFER == ("max_position_embeddings",)
    cfg = _run(f"run.init={init}", "model.max_position_embeddings=2048")
    assert cfg.model == dataclasses.replace(SMOLLM2_MODEL, max_position_embeddings=2048)
    # an architecture field that differs: one line naming the field, both values and the fix
    with pytest.raises(ConfigError) as e:
        _run(f"run.init={init}", "model.num_layers=4")
    assert str(e.value) == (
        f"model.num_layers=4 does not match run.init={init}, whose model has num_layers=30: "
        "drop model.num_layers to take the checkpoint's value, or point run.init at a "
        "checkpoint with num_layers=4 (only max_position_embeddings may differ from it)")
    with pytest.raises(ConfigError, match="^model.params_dtype=bfloat16 does not match"):
        _run(f"run.init={init}", "model.params_dtype=bfloat16")
    with pytest.raises(ConfigError, match="^model.norm_epsilon=1e-06 does not match"):
        _run(f"run.init={init}", "model.norm_epsilon=1e-6")
    # a model group chosen on the command line is every field of it, explicitly
    with pytest.raises(ConfigError, match="^model.family=qwen3 does not match run.init="):
        _run(f"run.init={init}", "model=qwen3-8b")
    with pytest.raises(ConfigError, match="^model.num_layers=4 does not match run.init="):
        _run(f"run.init={init}", "model=tiny")
    # the recipe's model (tiny: 4 layers) is not the command line's: no error above without it
    with pytest.raises(ConfigError, match="model.max_position_embeddings=0 must be >= 1"):
        _run(f"run.init={init}", "model.max_position_embeddings=0")


def test_tokenizer_of_run_init_unless_set(tmp_path):
    init = _hf(tmp_path / "smol")
    assert _run(f"run.init={init}", "rollout.tokenizer=game").rollout.tokenizer == "game"
    # a directory without tokenizer files keeps the recipe's tokenizer
    bare = _hf(tmp_path / "bare", tokenizer=False)
    assert _run(f"run.init={bare}").rollout.tokenizer == "game"
    # a converted checkpoint: its model config beside the weights, the tokenizer in hf/
    from earl_megatron.runtime.checkpoint import CONFIG_JSON
    ckpt = tmp_path / "ckpt"
    (ckpt / "hf").mkdir(parents=True)
    (ckpt / CONFIG_JSON).write_text(json.dumps(dataclasses.asdict(SMOLLM2_MODEL)))
    (ckpt / "metadata.json").write_text("{}")
    (ckpt / "hf" / "tokenizer.json").write_text("{}")
    cfg = _run(f"run.init={ckpt}", "model.num_query_groups=3")
    assert cfg.model == SMOLLM2_MODEL and cfg.rollout.tokenizer == str(ckpt)
    from earl_megatron.train import tokenizer_dir
    assert tokenizer_dir(cfg.rollout.tokenizer) == ckpt / "hf"


def test_run_init_problems_are_one_config_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=f"^run.init={tmp_path}/none does not exist"):
        _run(f"run.init={tmp_path}/none")
    mistral = _hf(tmp_path / "mistral", architectures=["MistralForCausalLM"])
    with pytest.raises(ConfigError, match=f"^run.init={mistral}: architecture "
                                          "MistralForCausalLM is not supported"):
        _run(f"run.init={mistral}")
    # a recipe's run.init may start with ~ (Hydra's command line refuses one): expanded
    monkeypatch.setenv("HOME", str(tmp_path))
    _hf(tmp_path / "home_model")
    d = apply_run_init({"run": {"init": "~/home_model"}, "rollout": {"tokenizer": "game"}})
    assert d["run"]["init"] == d["rollout"]["tokenizer"] == str(tmp_path / "home_model")
    # a TrainConfig built in code is checked as a whole (every field counts as given)
    from earl_megatron.train import validate
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    init = _hf(tmp_path / "smol")
    with pytest.raises(ConfigError, match="^model.num_layers=4 does not match"):
        validate(TrainConfig.from_dict({"run": {"init": init}}), 1)
    validate(TrainConfig.from_dict({"run": {"init": init},
                                    "model": dataclasses.asdict(SMOLLM2_MODEL)}), 1)


# ------------------------------------------------------------------ a layout that does not fit
def test_no_layout_fits_is_one_line_with_the_config_keys_that_fix_it(capsys):
    from earl_megatron.plan.selector import NoLayoutFitsError, Selector, SelectorConfig
    from earl_megatron.plan.specs import (
        GiB,
        Stage,
        StageWorkload,
        cluster_spec,
        human_bytes,
    )
    from earl_megatron.train import reporting_errors

    cfg = _run()   # the default recipe: a 0.25 GiB budget per rank
    assert cfg.layout.memory_budget_gb == 0.25
    cluster = cluster_spec("cpu", nodes=1, devices_per_node=2,
                           device_memory_bytes=int(0.25 * GiB))
    sel = Selector(SMOLLM2_MODEL, cluster, config=SelectorConfig(memory_margin=0.1))
    wl = StageWorkload.of(Stage.ROLLOUT, [128] * 64, responses_in_flight=64)
    with pytest.raises(NoLayoutFitsError) as e:
        sel.plan(wl)
    need = e.value.smallest.total

    def planning(_cfg):
        sel.plan(wl)

    with pytest.raises(SystemExit) as exit_:
        reporting_errors(planning, cfg)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    budget_gb = -(-need / 0.9 / GiB * 100 // 1) / 100     # rounded up to 0.01
    assert lines[0].startswith("layout error: no layout fits stage rollout in 230.4 MiB per "
                               "rank; the smallest is rollout ")
    assert lines[0].endswith(
        f". Fix: layout.memory_budget_gb={budget_gb:g} or more (now 0.25; the smallest layout "
        f"needs {human_bytes(need)} and layout.memory_margin=0.1 stays free)")
    assert budget_gb * GiB * 0.9 >= need > (budget_gb - 0.01) * GiB * 0.9
    # each of the selector's suggestions as the config key that makes it
    cluster = cluster_spec("cpu", nodes=1, devices_per_node=2, device_memory_bytes=2 * GiB)
    sel = Selector(SMOLLM2_MODEL, cluster, config=SelectorConfig(memory_margin=0.1))
    wl = StageWorkload.of(Stage.TRAIN, [128] * 64, micro_batch_tokens=512)
    with pytest.raises(SystemExit):
        reporting_errors(planning, TrainConfig.from_dict({"layout": {"memory_budget_gb": 2}}))
    line = capsys.readouterr().err
    assert "Would fit: 2 nodes (4 devices), e.g. CP2xPP2 at 1.4 GiB; recompute=full" in line
    assert line.endswith("stays free); or 4 ranks (cluster.nodes=2 x 2 per node); or "
                         "layout.recompute=full (or auto: the selector picks per iteration); or "
                         "algorithm.micro_batch_tokens=256\n")
    # the rollout's prefill chunk: rollout.prefill_tokens (the embedded engine's)
    sel = Selector(SMOLLM2_MODEL, cluster_spec("cpu", nodes=1, devices_per_node=2,
                                               device_memory_bytes=int(0.8 * GiB)),
                   config=SelectorConfig(memory_margin=0.1))
    wl = StageWorkload.of(Stage.ROLLOUT, [1024] * 16, responses_in_flight=16)
    with pytest.raises(SystemExit):
        reporting_errors(planning, TrainConfig.from_dict({"layout": {"memory_budget_gb": 0.8}}))
    line = capsys.readouterr().err
    assert "; or rollout.prefill_tokens=128; or rollout.max_context_tokens=59" in line, line
    assert "micro_batch_tokens" not in line, line


def test_the_command_line_takes_the_model_and_the_tokenizer_from_run_init(tmp_path):
    # the trainer's own entry point (Hydra's task overrides are what the user set): a model key
    # that contradicts run.init is one line; without it the model passes and the tokenizer is
    # run.init's (here a placeholder file, so loading it is the line that stops the run)
    import os
    import subprocess
    import sys

    init = _hf(tmp_path / "smol")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    says = {"model.num_layers=4": f"configuration error: model.num_layers=4 does not match "
                                  f"run.init={init}, whose model has num_layers=30: drop "
                                  "model.num_layers",
            "model.norm_epsilon=1e-5": f"configuration error: rollout.tokenizer={init}: "
                                       "transformers cannot load a tokenizer from"}
    for extra, line in says.items():
        proc = subprocess.run([sys.executable, "-m", "earl_megatron.train", f"run.init={init}",
                               extra, f"run.output_dir={tmp_path / 'out'}"], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        lines = [x for x in proc.stderr.splitlines() if x and not x.startswith("[rank")]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(line), \
            proc.stderr[-3000:]


def test_fewer_responses_in_flight_under_asynchronous_rl_is_a_smaller_batch_or_k():
    # (k + 1) batches are in flight with algorithm.max_staleness = k: the selector's
    # responses_in_flight=74 is a batch of 37 at k = 1 (whole groups), or k = 0
    from earl_megatron.plan.specs import Stage
    from earl_megatron.plan.what_fits import NoLayoutFitsError
    from earl_megatron.train import layout_fix

    e = NoLayoutFitsError(Stage.ROLLOUT, 1, None, ("responses_in_flight=74",))
    sync = TrainConfig.from_dict({})
    assert layout_fix(e, sync) == ". Fix: rollout.episodes_per_iteration=74"
    k1 = TrainConfig.from_dict({"algorithm": {"max_staleness": 1, "off_policy": "decoupled",
                                              "old_logprobs": "recompute", "name": "grpo",
                                              "group_size": 4}})
    assert layout_fix(e, k1) == (". Fix: rollout.episodes_per_iteration=36; or "
                                 "algorithm.max_staleness=0 (fewer batches in flight)")
