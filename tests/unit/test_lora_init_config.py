"""A LoRA run from ``run.init`` (single process, no model): the composed config keeps the run's
``model.lora`` over the checkpoint's model, and the stage planner counts a LoRA run's KL
reference as the policy's own base (no weights of its own); a PEFT adapter's base must be local."""

import json

from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.config.model import ModelConfig
from earl_megatron.config.train import LayoutConfig, TrainConfig
from earl_megatron.models.lora import LoraSpec
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.train import apply_run_init
from earl_megatron.trainer.planner import StagePlanner
from earl_megatron.trainer.stages import BatchShape
from earl_megatron.weights.hf_mapping import to_hf_config


def _hf_dir(tmp_path):
    """An HF directory's config.json (apply_run_init reads nothing else): a 6-layer model."""
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(
        ModelConfig.tiny(num_layers=6, vocab_size=32))))
    return str(tmp_path)


def test_run_init_keeps_the_runs_lora_section(tmp_path):
    init = _hf_dir(tmp_path)
    recipe = {"num_layers": 4, "vocab_size": 128,        # the recipe's model: not the checkpoint
              "lora": {"rank": 16, "alpha": 32.0, "dropout": 0.0,
                       "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}}
    for keys in ([], ["model.lora.rank"], ["model.lora.targets", "run.init"]):
        d = apply_run_init({"run": {"init": init}, "model": recipe, "rollout": {}}, keys)
        model = TrainConfig.from_dict(d).model
        assert (model.num_layers, model.vocab_size) == (6, 32), keys   # the checkpoint's
        assert model.lora == LoraSpec(16, 32.0), keys                  # the run's
    # no lora section given: the checkpoint's (an HF model has none)
    d = apply_run_init({"run": {"init": init}, "model": {}, "rollout": {}}, [])
    assert TrainConfig.from_dict(d).model.lora == LoraSpec()


def test_the_planner_counts_no_second_model_for_a_lora_reference():
    lora = ModelConfig.tiny(vocab_size=32, lora=LoraSpec(rank=4, alpha=8))
    lay = ParallelLayout.parse("tp1", world_size=1, model=lora)

    def planner(model):
        return StagePlanner(model, LayoutConfig(), ClusterConfig(), 1,
                            distributed_optimizer=False, episodes=4, batch=BatchShape(2))

    full, adapted = planner(lora.base), planner(lora)
    # the full model's reference: its own 152,128 fp32 weights; its policy beside it adds
    # grads (4 B) and Adam's two moments (8 B) per weight
    assert full.weight_bytes(lay) == 152_128 * 4
    assert full.train_bytes(lay) == 152_128 * (4 + 4 + 8)
    # LoRA: the reference is the policy's base (0 B of its own); beside it, the 13,312
    # adapters' grads and moments only (the weights are the ones the reference runs on)
    assert adapted.weight_bytes(lay) == 0 and adapted.weight_bytes(None) == 0
    assert adapted.train_bytes(lay) == 13_312 * (4 + 8)


def test_a_peft_adapter_without_a_local_base_is_one_line(tmp_path):
    # a PEFT adapter as run.init starts from its base (tests/unit/test_peft_adapter_init.py), which
    # must be a local directory: nothing is downloaded
    import pytest

    from earl_megatron.config.checks import ConfigError
    from earl_megatron.train import init_config

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(ConfigError) as e:
        init_config(str(tmp_path))
    assert str(e.value).startswith(f"run.init={tmp_path}: {tmp_path}: base_model_name_or_path="
                                   "None is not a local model directory")
    assert "\n" not in str(e.value)
