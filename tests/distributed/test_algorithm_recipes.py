"""Every recipe of recipes/algorithm/ trains 3 iterations on 2 ranks with layout=auto (one launch).

Each recipe is composed by Hydra as a user's `algorithm=NAME` (the CPU default recipe, Connect
Four, made small: 16 episodes of at most 3 turns); each run records 3 metrics lines with a
finite loss, the advantages it trained on have its estimator's defining property on the global
batch, the KL is measured exactly when the recipe has one, and the knobs the recipe sets reach
the run (its resolved.json)."""

import json
import math
import pathlib

from earl_megatron.testing.multiproc import run_distributed

RECIPES = sorted(p.stem for p in
                 (pathlib.Path(__file__).parents[2] / "recipes" / "algorithm").glob("*.yaml"))
SMALL = ["rollout.episodes_per_iteration=16", "rollout.max_turns=3", "run.iterations=3",
         "run.checkpoint_every=0", "run.eval_every=0", "run.eval_episodes=2",
         "run.live_view=false", "run.samples_per_iteration=0", "layout=auto",
         "env.eval_opponents=[random]"]


def _all(root):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from earl_megatron.config.train import TrainConfig
    from earl_megatron.train import RECIPES as RECIPE_DIR
    from earl_megatron.train import run

    out = {}
    for name in RECIPES:
        with initialize_config_dir(config_dir=str(RECIPE_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=[
                f"algorithm={name}", f"run.output_dir={root}/{name}", *SMALL])
        out[name] = run(TrainConfig.from_dict(OmegaConf.to_container(cfg, resolve=True)))
    return out


def test_every_recipe_trains_three_iterations_on_two_ranks(tmp_path):
    results = run_distributed(_all, 2, str(tmp_path), timeout=1200)
    assert sorted(results[0]) == RECIPES and len(RECIPES) >= 10
    for name, hist in results[0].items():
        resolved = json.loads((tmp_path / name / "resolved.json").read_text())["algorithm"]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["iteration"] for x in lines] == [0, 1, 2], name
        assert [h["loss"] for h in hist] == [h["loss"] for h in results[1][name]], name
        for h in hist:
            assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]), (name, h)
            if resolved["name"] in ("grpo", "rloo"):
                assert h["advantage_group_mean_max"] < 1e-6, (name, h)
            else:
                assert abs(h["advantage_mean"]) < 1e-6, (name, h)
            assert ("kl" in h) == (resolved["kl_mode"] != "off"), name
            assert h["staleness_max"] <= resolved["max_staleness"], (name, h)
            # the selector's predicted seconds per planned stage, beside the measured ones
            assert {"rollout", "train"} <= set(h["predicted_seconds"]) <= set(h["seconds"]), h
    # the recipes' own knobs reach the runs
    algo = {n: json.loads((tmp_path / n / "resolved.json").read_text())["algorithm"]
            for n in RECIPES}
    assert algo["gspo"]["policy_loss"] == "gspo" and algo["gspo"]["clip_eps_high"] == 4e-4
    assert algo["cispo"]["policy_loss"] == "cispo"
    assert algo["dr_grpo"]["norm_by_std"] is False
    assert algo["dr_grpo"]["loss_agg"] == "seq_mean_token_sum_norm"
    assert algo["rloo"]["name"] == "rloo" and algo["rloo"]["kl_estimator"] == "k1"
    assert algo["reinforce_pp_baseline"]["kl_estimator"] == "k2"
    assert algo["dapo"]["dynamic_sampling"] and algo["dapo"]["clip_eps_high"] == 0.28
