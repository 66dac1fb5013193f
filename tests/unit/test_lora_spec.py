"""LoraSpec's validation (the model.lora section), the loop's one-line refusals of what it cannot do
with adapters yet, and the adapter's tp slicing rule (single process, no model)."""

import pytest
import torch

from earl_megatron.models.lora import TARGETS, LoraSpec, _slice, _unslice


def test_spec_defaults_and_scaling():
    spec = LoraSpec(rank=8, alpha=16)
    assert spec.targets == TARGETS
    assert spec.dropout == 0.0
    assert spec.scaling == 2.0
    # a list is kept as a tuple (the spec stays hashable and frozen)
    assert LoraSpec(rank=4, alpha=4, targets=["linear_qkv"]).targets == ("linear_qkv",)
    assert LoraSpec(rank=4, alpha=4, targets="linear_fc2").targets == ("linear_fc2",)
    # the config section's default is off
    assert not LoraSpec().enabled and LoraSpec().scaling == 0.0 and spec.enabled


@pytest.mark.parametrize("kwargs,words", [
    (dict(rank=-1, alpha=8), "model.lora.rank=-1"),
    (dict(rank=2.5, alpha=8), "positive integer"),
    (dict(rank=True, alpha=8), "model.lora.rank=True"),
    (dict(rank=8, alpha=0), "model.lora.alpha=0"),
    (dict(rank=8, alpha=float("nan")), "positive number"),
    (dict(rank=8, alpha=8, dropout=1.0), "model.lora.dropout=1.0"),
    (dict(rank=8, alpha=8, dropout=-0.1), "[0, 1)"),
    (dict(rank=8, alpha=8, targets=("q_proj",)), "['q_proj'] unknown"),
    (dict(rank=8, alpha=8, targets=()), "targets is empty"),
    (dict(rank=8, alpha=8, targets=("linear_qkv", "linear_qkv")), "repeats"),
    # off (rank 0) still checks the rest: a typo in a disabled section is a typo
    (dict(rank=0, alpha=-1), "model.lora.alpha=-1"),
])
def test_spec_refuses_bad_values_naming_them(kwargs, words):
    with pytest.raises(ValueError) as e:
        LoraSpec(**kwargs)
    assert words in str(e.value)


def test_slice_follows_megatron_partition_stride():
    full = torch.arange(8.0).unsqueeze(1)           # rows 0..7, e.g. SwiGLU fc1's [gate; up]
    # stride 2 on tp 2: rank r holds [gate_r; up_r] = chunks r and r + 2 of 4
    assert _slice(full, 0, 2, 0, 2).flatten().tolist() == [0, 1, 4, 5]
    assert _slice(full, 0, 2, 1, 2).flatten().tolist() == [2, 3, 6, 7]
    assert _slice(full, 0, 1, 1, 2).flatten().tolist() == [4, 5, 6, 7]
    cols = torch.arange(12.0).reshape(2, 6)
    assert _slice(cols, 1, 1, 2, 3).tolist() == [[4, 5], [10, 11]]
    for dim, stride, tp, t in [(0, 2, 2, full), (0, 1, 4, full), (1, 1, 3, cols)]:
        parts = [_slice(t, dim, stride, r, tp) for r in range(tp)]
        assert torch.equal(_unslice(parts, dim, stride), t)


@pytest.mark.parametrize("sections,words", [
    (dict(sft={"steps": 2}, algorithm={"kl_mode": "loss", "kl_coef": 0.1}),
     "set algorithm.kl_mode=off, or sft.steps=0"),
    (dict(model={"family": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 32}),
     "use model.lora.targets=[linear_qkv"),
])
def test_what_the_loop_cannot_do_with_lora_is_refused_in_one_line(tmp_path, sections, words):
    from earl_megatron.config.checks import ConfigError
    from earl_megatron.testing.configs import tiny_connect_four
    from earl_megatron.train import validate

    model = {"lora": {"rank": 4}, **sections.pop("model", {})}
    with pytest.raises(ConfigError) as e:
        # the static layouts are parsed by the pre-launch check's validate (train.py)
        validate(tiny_connect_four(str(tmp_path), model=model, **sections), 2)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert "model.lora" in str(e.value)


@pytest.mark.parametrize("layout", [{}, {"mode": "auto"}], ids=["dp2_tp2_tp2", "auto"])
def test_lora_runs_on_switching_layouts(tmp_path, layout):
    """The switcher moves adapters (tests/distributed/test_lora_switch.py): stages may differ."""
    from earl_megatron.testing.configs import tiny_connect_four
    from earl_megatron.train import validate

    validate(tiny_connect_four(str(tmp_path), model={"lora": {"rank": 4}}, layout=layout), 2)


def test_lora_keys_reach_the_model_config(tmp_path):
    from earl_megatron.testing.configs import tiny_connect_four

    cfg = tiny_connect_four(str(tmp_path), model={"lora": {
        "rank": 4, "alpha": 8, "dropout": 0.1, "targets": ["linear_qkv", "linear_fc2"]}})
    assert cfg.model.lora == LoraSpec(4, 8.0, 0.1, ("linear_qkv", "linear_fc2"))
    assert cfg.model.base.lora == LoraSpec() and cfg.model.base.with_(lora=cfg.model.lora) \
        == cfg.model
    # a checkpoint's earl_model_config.json (dataclasses.asdict) reads back to the same config
    import dataclasses
    import json
    from earl_megatron.config.model import ModelConfig
    assert ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg.model)))) == cfg.model


def test_a_model_with_adapters_builds_megatrons_local_layers_where_te_is_usable(monkeypatch):
    """TE's qkv linear fuses the input norm (an adapter beside it would see the un-normed
    input): with TE importable on a GPU, a LoRA model still takes the local spec."""
    from megatron.core.transformer.attention import SelfAttention

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models import provider
    from earl_megatron.plan.layout import ParallelLayout

    monkeypatch.setattr(provider, "te_available", lambda: True)
    plain, adapted = ModelConfig(), ModelConfig(lora=LoraSpec(rank=4, alpha=8.0))
    assert provider.te_layers(plain) and not provider.te_layers(adapted)
    spec = provider.layer_spec(ParallelLayout(), adapted)
    qkv = spec.submodules.self_attention.submodules.linear_qkv
    assert spec.submodules.self_attention.module is SelfAttention
    assert "TE" not in qkv.__name__, qkv


def test_sglang_servers_serve_the_adapters(tmp_path):
    """rollout.engine=sglang with LoRA is no longer refused: the servers start with adapters on
    (the rank and the HF modules, CPU's torch backend and the kit's pinning shim)."""
    from earl_megatron.rollout.sglang_launch import SGLangConfig, server_command, server_variables
    from earl_megatron.config.train import TrainConfig
    from earl_megatron.testing.configs import tiny_connect_four
    from earl_megatron.weights.peft_export import target_modules

    # the pre-launch check's validate would also ask the venv's python to import sglang
    cfg = tiny_connect_four(str(tmp_path), model={"lora": {"rank": 4}},
                            rollout={"engine": "sglang"})
    assert isinstance(cfg, TrainConfig) and cfg.model.lora.rank == 4
    mods = tuple(target_modules(cfg.model))
    assert mods == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    sc = SGLangConfig(python="py", model_path="m", device="cpu", lora_rank=4, lora_targets=mods)
    cmd = server_command(sc, 0, 1234, "m")
    i = cmd.index("--lora-target-modules")
    assert cmd[i + 1:i + 8] == list(mods) and "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "4"
    assert cmd[cmd.index("--lora-backend") + 1] == "torch_native"
    assert server_variables(sc)["EARL_SGLANG_CPU_PINNING"] == "off"
    gpu = server_command(SGLangConfig(python="py", model_path="m", lora_rank=4,
                                      lora_targets=mods), 0, 1234, "m")
    assert "--lora-backend" not in gpu and "--enable-lora" in gpu
    plain = SGLangConfig(python="py", model_path="m", device="cpu")
    assert "--enable-lora" not in server_command(plain, 0, 1, "m")
    assert "EARL_SGLANG_CPU_PINNING" not in server_variables(plain)
    with pytest.raises(ValueError, match="lora_rank"):
        SGLangConfig(python="py", model_path="m", lora_rank=4)
