"""One switch for asynchronous RL (issue #43, item 3): ``algorithm=async`` or
``algorithm.max_staleness=1`` alone is decoupled PPO on the trainer's re-scoring.

algorithm.off_policy and algorithm.old_logprobs default to "auto", resolved once at construction
from max_staleness (config/algorithm.py): k=0 gives today's defaults exactly (none, rollout), so a
synchronous run is value for value the run it was; k>=1 gives decoupled and recompute. A value
the user gives wins, and the refusals of contradictory values stand. The run's first line says
what was chosen (config/train.py ``config_notes``)."""

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from earl_megatron.config.algorithm import AlgorithmConfig
from earl_megatron.config.compose import RECIPES, compose
from earl_megatron.config.train import ConfigError, TrainConfig, config_notes

ASYNC_NOTE = ("algorithm.max_staleness=1 (asynchronous RL): decoupled PPO (a token whose weight "
              "pi_prox / pi_behav exceeds 2 is dropped) on the trainer's re-scoring of each batch "
              "before TRAIN; chosen for you: algorithm.off_policy=decoupled, "
              "algorithm.old_logprobs=recompute (set them to choose otherwise)")


def _composed(*args) -> TrainConfig:
    return TrainConfig.from_dict(OmegaConf.to_container(compose(list(args)), resolve=True))


def test_synchronous_defaults_are_unchanged():
    a = AlgorithmConfig()
    assert (a.off_policy, a.old_logprobs, a.off_policy_weights) == ("none", "rollout", None)
    assert a.chosen == ("off_policy", "old_logprobs")
    assert config_notes(TrainConfig()) == []          # a k=0 run starts as it always did
    assert TrainConfig().to_dict()["algorithm"]["off_policy"] == "none"   # resolved.json


@pytest.mark.parametrize("recipe", sorted(p.stem for p in Path(RECIPES).glob("*.yaml")))
def test_every_recipe_at_k0_is_the_config_it_was(recipe):
    """The recipes now say auto; composed, each is equal, field for field, to the same recipe
    with today's explicit values (none, rollout): no k=0 run changes."""
    args = ["--config-name", recipe, "run.init=/ckpt/hf"]   # the GPU recipes' tokenizer
    auto = _composed(*args)
    assert auto.algorithm.max_staleness == 0
    assert auto == _composed(*args, "algorithm.off_policy=none", "algorithm.old_logprobs=rollout")
    assert [n for n in config_notes(auto) if not n.startswith("algorithm.lr=")] == []


def test_a_random_init_learning_rate_on_a_pretrained_checkpoint_gets_a_note():
    """The default recipe's lr (1e-2, the tiny random model's) with run.init: a note naming
    both and the fix; the real recipes' rates, and any rate without run.init, say nothing."""
    note = _composed("run.init=/ckpt/hf")
    assert note.algorithm.lr == 1e-2
    assert config_notes(note) == [
        "algorithm.lr=0.01 on the pretrained run.init=/ckpt/hf: that rate is for a randomly "
        "initialised model; a pretrained one usually RL-trains at 1e-6 to 5e-5 "
        "(recipes/smollm2_tool.yaml: 2e-5, 2e-4 with LoRA adapters); set algorithm.lr"]
    assert config_notes(_composed()) == []                                  # no run.init
    assert config_notes(_composed("run.init=/ckpt/hf", "algorithm.lr=2e-5")) == []
    for recipe in ("qwen2.5-7b", "smollm2_tool", "smollm2_tool_lora"):
        assert config_notes(_composed("--config-name", recipe, "run.init=/ckpt/hf")) == [], recipe


def test_one_switch_is_the_three_keys():
    three = _composed("algorithm.max_staleness=1", "algorithm.off_policy=decoupled",
                      "algorithm.old_logprobs=recompute")
    for switch in (["algorithm=async"], ["algorithm.max_staleness=1"]):
        cfg = _composed(*switch)
        assert cfg == three, switch
        assert (cfg.algorithm.off_policy, cfg.algorithm.old_logprobs) == ("decoupled",
                                                                          "recompute")
        assert cfg.algorithm.off_policy_weights == ("decoupled", 2.0)
        assert config_notes(cfg) == [ASYNC_NOTE]
    # the three keys given: nothing was chosen, nothing to say
    assert three.algorithm.chosen == () and config_notes(three) == []
    # k=2 alone too; in code as on the command line
    a = AlgorithmConfig(max_staleness=2)
    assert (a.max_staleness, a.off_policy, a.old_logprobs) == (2, "decoupled", "recompute")


def test_a_given_value_wins():
    cfg = _composed("algorithm.max_staleness=1", "algorithm.off_policy=tis",
                    "algorithm.off_policy_cap=3")
    assert cfg.algorithm.off_policy_weights == ("tis", 3.0)
    assert cfg.algorithm.old_logprobs == "recompute" and cfg.algorithm.chosen == ("old_logprobs",)
    assert config_notes(cfg) == [
        "algorithm.off_policy=tis: truncated importance sampling (weights pi_prox / pi_behav "
        "capped at 3) on the trainer's re-scoring of each batch before TRAIN; chosen for you: "
        "algorithm.old_logprobs=recompute (set it to choose otherwise)"]
    # off-policy weights at k=0 need the re-scoring, which auto then chooses (refused before)
    a = AlgorithmConfig(off_policy="decoupled")
    assert (a.max_staleness, a.old_logprobs) == (0, "recompute")
    # the resolved values are plain values: a saved config reads back equal, chosen by nobody
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.algorithm.chosen == ()


@pytest.mark.parametrize("given, says", [
    (["algorithm.off_policy=none"], "algorithm.max_staleness=1 trains tokens sampled by older "
     "weights, which algorithm.off_policy=none leaves uncorrected: drop algorithm.off_policy "
     "(auto: decoupled, with old_logprobs=recompute) or set it to decoupled or tis"),
    (["algorithm.old_logprobs=rollout"], "algorithm.off_policy=decoupled weights by pi_prox / "
     "pi_behav, which needs the trainer's re-scoring: set algorithm.old_logprobs=recompute, or "
     "drop it (auto chooses recompute; with 'rollout' the ratio is 1 by definition)"),
])
def test_an_explicit_contradiction_is_still_refused(given, says):
    with pytest.raises(ConfigError) as e:
        _composed("algorithm=async", *given)
    assert str(e.value) == says


def test_a_cap_at_k0_names_why_off_policy_is_none():
    with pytest.raises(ConfigError) as e:
        AlgorithmConfig(off_policy_cap=3.0)
    assert str(e.value) == ("algorithm.off_policy_cap=3.0 does nothing with algorithm."
                            "off_policy=none (auto at algorithm.max_staleness=0): set "
                            "off_policy=tis or decoupled, or drop the cap")
    with pytest.raises(ConfigError, match="use none, tis, decoupled or auto"):
        AlgorithmConfig(off_policy="decoupld")
    with pytest.raises(ConfigError, match="use rollout, recompute or auto"):
        AlgorithmConfig(old_logprobs="recomput")


def test_replace_passes_resolved_values_on_as_given():
    """dataclasses.replace hands the resolved values to the new instance: to turn a resolved
    synchronous config asynchronous in code, say auto again (or build it anew)."""
    sync = AlgorithmConfig()
    with pytest.raises(ConfigError, match="off_policy=none leaves uncorrected"):
        dataclasses.replace(sync, max_staleness=1)
    k1 = dataclasses.replace(sync, max_staleness=1, off_policy="auto", old_logprobs="auto")
    assert k1 == AlgorithmConfig(max_staleness=1)
