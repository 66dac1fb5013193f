"""PPO with a critic through the trainer (algorithm.name=ppo, issue #45): one 2-rank launch.

tiny_connect_four (rollout dp2, LOGPROB and TRAIN tp2: the critic lives in tp2, the policy
switches between dp2 and tp2 every iteration), GAE with gamma 0.99 and lam 0.9, one iteration
of critic warm-up, KL in the loss (the reference beside the critic), 3 iterations:

- every record holds value_loss, explained_variance, value_clip_frac, value_mean and
  return_mean, finite, the clip fraction in [0, 1]; the advantages have mean 0 over the global
  batch's policy tokens; the timers are the known ones, "values" and "critic_train" among them;
- iteration 0 (the warm-up) trains the critic only: no policy loss, no weight sync; 1 and 2
  train both;
- the critic's checkpoint (critic/ in the iteration's directory) holds weights other than its
  initial ones, every trunk tensor and the head (it trained); the trainer's CRITIC TRAIN stage
  on one fixed batch (no clip) lowers the value loss step after step, to below a tenth;
- algorithm.critic.init=<that run's last checkpoint>: the same first batch (the policy from the
  seed) scored by that run's trained critic, trunk and head (weights/critic_import.py); the
  same critic exported as an HF value model (earl convert mcore-to-hf --critic) scores it the
  same (1e-6); the checkpoint's policy exported as an HF causal LM gives a critic of the
  trained policy's trunk and a new head: other values again;
- a warm start (sft.steps=2 on the calculator's scripted expert) before RL: the critic's
  trunk is the warmed policy's, bit-exact (its own steps made too small to move fp32 weights:
  critic.lr 1e-30, so the trunk saved at iteration 0 is the one it was built with), not the
  seed's initial policy's;
- layout.mode=auto under a 0.015 GB budget with algorithm.max_staleness=1 (3 iterations): the
  critic, built in TP2, moves with the context: to DP2, the first batch's TRAIN layout, then
  with the policy's TRAIN to CP2 as the contexts grow (the switcher moving its weights, head and
  Adam state), while the policy rolls out in DP2; iterations 1 and 2 train tokens one
  version old (staleness_max 1), their values scored by the critic of the iteration that trains
  them; every value metric finite; and 2 iterations resumed to 3 record what 3 do, every metric
  but the timings (the critic built where it was, its weights and Adam state from critic/);
  and the critic's values of a fixed batch are bit-equal before and after the policy switches
  DP2 -> TP2 -> CP2 -> DP2 beside it.
"""

import math

import pytest

from earl_megatron.stages import ITERATION_TIMERS
from earl_megatron.testing.configs import tiny_connect_four
from earl_megatron.testing.multiproc import run_distributed

PPO = {"name": "ppo", "gamma": 0.99, "lam": 0.9, "kl_mode": "loss", "kl_coef": 0.1,
       "critic": {"lr": 1e-2, "clip": 0.2, "warmup": 1}}
VALUE_KEYS = ("value_loss", "explained_variance", "value_clip_frac", "value_mean",
              "return_mean", "value_grad_norm")


WARM = {"model": {"vocab_size": 64},
        "env": {"name": "calculator", "kwargs": {"system_prompt": "", "num_operands": 2},
                "eval_opponents": []},
        "rollout": {"tokenizer": "tool", "episodes_per_iteration": 4, "max_turns": 3,
                    "max_action_tokens": 16},
        "sft": {"steps": 2, "batch_size": 4, "expert_episodes": 8}}
"""The warm-started run: the calculator, whose scripted expert the warm start imitates."""


def _cfg(out, iterations, algorithm=None, sections=None, **critic):
    return tiny_connect_four(out, algorithm={**PPO, "critic": {**PPO["critic"], **critic},
                                             **(algorithm or {})},
                             run={"iterations": iterations}, **(sections or {}))


AUTO = {"layout": {"mode": "auto", "memory_budget_gb": 0.015},
        "rollout": {"prefill_tokens": 256}}
"""Auto layouts under a budget that builds the critic in TP2 (the selector's TRAIN choice for a
planned first batch of 128 tokens, with the policy's train state counted in each candidate's
own layout: TP2 without recompute, 13.5 of 13.8 MiB; plan/critic_memory.py), the rollout in
DP2 (its prefill cut to 256 tokens to fit), and each batch's TRAIN, where the critic follows,
in DP2 for the first batch's short episodes and CP2 from iteration 1 (trainer/planner.py)."""


def _critic_changed(root, cfg):
    """{tensor: changed?} of the critic saved at iteration 2 against the critic the run starts
    with (the policy's seeded initial weights, the head from run.seed)."""
    import torch
    import torch.distributed as dist

    from earl_megatron.models.value_model import critic_config, critic_loader
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.checkpoint import load_model_state
    from earl_megatron.runtime.checkpoint_files import checkpoint_dir
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.weights.gather import gather_full

    ccfg = critic_config(cfg.model)
    lay = ParallelLayout.parse("tp2", world_size=dist.get_world_size(), model=cfg.model)
    with cpu_backend():
        policy = build_on_layout(cfg.model, lay, ddp=False, seed=cfg.run.seed)
        weights = gather_full(policy.model, cfg.model, lay)

        def critic():
            return build_on_layout(ccfg, lay, ddp=False, seed=cfg.run.seed,
                                   load=critic_loader(weights, ccfg, lay))

        start, end = critic(), critic()
        load_model_state(end, checkpoint_dir(f"{root}/checkpoints", 2) / "critic")
    s, e = start.module().state_dict(), end.module().state_dict()
    return {k: not torch.equal(s[k], e[k]) for k in s if not k.endswith("_extra_state")}


def _critic_from_warmed_policy(root, cfg):
    """(the critic saved at iteration 0 has the last warm-start checkpoint's trunk, bit-exact;
    it differs from the seed's initial policy) for the run at ``root``."""
    import torch
    import torch.distributed as dist

    from earl_megatron.models.value_model import CriticTrunk, critic_config, critic_loader
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.checkpoint import load_checkpoint, load_model_state
    from earl_megatron.runtime.checkpoint_files import checkpoint_dir
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.trainer.warm_start import warm_start_state
    from earl_megatron.weights.gather import gather_full

    ccfg = critic_config(cfg.model)
    lay = ParallelLayout.parse("tp2", world_size=dist.get_world_size(), model=cfg.model)
    with cpu_backend():
        initial = build_on_layout(cfg.model, lay, ddp=False, seed=cfg.run.seed)
        start = gather_full(initial.model, cfg.model, lay)
        warmed = build_on_layout(cfg.model, lay, ddp=False, seed=cfg.run.seed)
        load_checkpoint(warmed, warm_start_state(root)["path"])
        warm = gather_full(warmed.model, cfg.model, lay)
        critic = build_on_layout(ccfg, lay, ddp=False, seed=cfg.run.seed,
                                 load=critic_loader(start, ccfg, lay))
        load_model_state(critic, checkpoint_dir(f"{root}/checkpoints", 0) / "critic")
        trunk = gather_full(CriticTrunk(critic.model), ccfg, lay)
    return (all(torch.equal(t, warm[k]) for k, t in trunk.items()),
            any(not torch.equal(t, start[k]) for k, t in trunk.items()))


def _fixed_batch_losses(cfg, steps=6):
    """The trainer's CRITIC TRAIN stage (trainer/critic.train_critic) ``steps`` times on one
    fixed batch of 6 episodes (policy tokens after the first 8, returns 0.5 + 0.1 s, no value
    clip), the critic built by the trainer's build_critic in tp2: each step's value loss."""
    import torch
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.trainer.critic import build_critic, train_critic
    from earl_megatron.trainer.data import episode_tensors
    from earl_megatron.trainer.stages import BatchShape, micro_batch_plan

    lay = ParallelLayout.parse("tp2", world_size=dist.get_world_size(), model=cfg.model)
    g = torch.Generator().manual_seed(0)
    ids = list(range(6))
    tokens = {s: torch.randint(0, cfg.model.vocab_size, (20 + 4 * s,), generator=g).tolist()
              for s in ids}
    with cpu_backend():
        critic = build_critic(cfg, build_on_layout(cfg.model, lay, ddp=False,
                                                   seed=cfg.run.seed), lay)
        plan = micro_batch_plan(lay, {s: len(t) for s, t in tokens.items()}, BatchShape(4),
                                cfg.model)
        samples = {s: episode_tensors(t, [0] * 8 + [1] * (len(t) - 8), [0.0] * len(t), 1.0,
                                      plan.length_of[s]) for s, t in tokens.items()}
        returns = {s: samples[s].loss_mask * (0.5 + 0.1 * s) for s in ids}
        old = {s: torch.zeros_like(samples[s].loss_mask) for s in ids}
        return [train_critic(critic, lay, ids, samples, old, returns, plan, None, 1)
                ["value_loss"] for _ in range(steps)]


def _values_across_switches(cfg):
    """The critic built by the trainer in CP2 beside a policy in DP2 (ModelPair), its values of
    6 fixed episodes (produced in DP2) before and after the policy switches DP2 -> TP2 -> CP2
    (the critic's own layout) -> DP2, with the critic's groups re-activated each time."""
    import types

    import torch
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import OptimizerSpec
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.trainer.critic import build_critic, values_of
    from earl_megatron.trainer.model_pair import build_model_pair
    from earl_megatron.trainer.stages import BatchShape

    world = dist.get_world_size()
    lay = {n: ParallelLayout.parse(n, world_size=world, model=cfg.model)
           for n in ("dp2", "tp2", "cp2")}
    g = torch.Generator().manual_seed(1)
    tokens = {s: 20 + 5 * s for s in range(6)}
    rows = {s: torch.randint(0, cfg.model.vocab_size, (n,), generator=g).tolist()
            for s, n in tokens.items()}
    ids = [s for s in rows if s // 3 == lay["dp2"].coords(dist.get_rank()).dp]
    episodes = [types.SimpleNamespace(token_ids=rows[s]) for s in ids]
    with cpu_backend():
        models = build_model_pair(cfg.model, lay["dp2"], None, seed=cfg.run.seed,
                                  optimizer=OptimizerSpec(lr=1e-3))
        models.add_critic(build_critic(cfg, models.policy_in(lay["cp2"]), lay["cp2"]))

        def values():
            return values_of(models.critic_in(lay["cp2"]), lay["dp2"], ids, episodes, tokens,
                             0, BatchShape(4))[0]

        before = values()
        for name in ("tp2", "cp2", "dp2"):
            models.policy_in(lay[name])
            after = values()
    return {"ids": ids, "equal": all(torch.equal(before[s], after[s]) for s in ids),
            "lengths": [before[s].numel() for s in ids]}


def _all(root):
    from earl_megatron.train import run

    from earl_megatron.testing.calls import callers
    from earl_megatron.trainer import critic

    # the critic's trunk copied shard by shard from the policy moved into its layout
    with callers(critic, "copied_from") as copies:
        full = run(_cfg(f"{root}/full", 3))
    # critic.init: the trunk from the full run's last checkpoint (its trained policy), the
    # policy from the seed as before: the same first batch, other values
    from earl_megatron.runtime.checkpoint_files import checkpoint_dir
    init = run(_cfg(f"{root}/init", 1, init=str(checkpoint_dir(f"{root}/full/checkpoints", 2))))
    # auto layouts, asynchronous: episodes carried over from the previous stage, scored by
    # today's critic; resumed, the critic's layout is chosen again and its state read back
    warm = _cfg(f"{root}/warm", 1, sections=WARM, lr=1e-30)
    run(warm)
    k1 = {"max_staleness": 1}
    auto = run(_cfg(f"{root}/auto", 3, algorithm=k1, sections=AUTO))
    run(_cfg(f"{root}/auto_resumed", 2, algorithm=k1, sections=AUTO))
    auto_resumed = run(_cfg(f"{root}/auto_resumed", 3, algorithm=k1, sections=AUTO))
    strip = lambda hs: [{k: v for k, v in h.items() if k != "seconds"} for h in hs]  # noqa: E731
    return {"full": full, "init": init[0], "auto": auto,
            "copies": copies,
            "auto_equal": strip(auto) == strip(auto_resumed),
            "switches": _values_across_switches(_cfg(f"{root}/full", 3)),
            "changed": _critic_changed(f"{root}/full", _cfg(f"{root}/full", 3)),
            "warmed": _critic_from_warmed_policy(f"{root}/warm", warm),
            "fixed_batch": _fixed_batch_losses(_cfg(f"{root}/full", 3, lr=3e-3))}


def _inits(root, value_model, causal_lm):
    from earl_megatron.train import run

    return {name: run(_cfg(f"{root}/{name}", 1, init=path))[0]
            for name, path in (("value_model", value_model), ("causal_lm", causal_lm))}


@pytest.mark.timeout(900)
def test_ppo_trains_a_critic_beside_the_policy_and_resumes_exactly(tmp_path):
    from earl_megatron.runtime.checkpoint_files import checkpoint_dir
    from earl_megatron.testing.peft_check import export

    results = run_distributed(_all, 2, str(tmp_path), timeout=800)
    last = checkpoint_dir(tmp_path / "full" / "checkpoints", 2)
    export(str(last), str(tmp_path / "hf_value"), "--critic")
    export(str(last), str(tmp_path / "hf_policy"))
    inits = run_distributed(_inits, 2, str(tmp_path), str(tmp_path / "hf_value"),
                            str(tmp_path / "hf_policy"), timeout=300)[0]
    strip = lambda hs: [{k: v for k, v in h.items() if k != "seconds"} for h in hs]  # noqa: E731
    a, b = strip(results[0]["full"]), strip(results[1]["full"])
    assert a == b, [(k, x[k], y.get(k)) for x, y in zip(a, b) for k in x if x[k] != y.get(k)]
    for r in results:
        assert r["copies"] == ["build_critic"], r["copies"]
        hist = r["full"]
        assert [h["iteration"] for h in hist] == [0, 1, 2]
        for h in hist:
            for key in VALUE_KEYS:
                assert math.isfinite(h[key]), (key, h)
            assert 0.0 <= h["value_clip_frac"] <= 1.0, h
            assert h["value_loss"] > 0 and abs(h["advantage_mean"]) < 1e-6, h
            assert {"values", "critic_train"} <= set(h["seconds"]) <= \
                {*ITERATION_TIMERS, "total"}, h["seconds"]
            # CRITIC TRAIN planned on its own: no budget to speak of, so the fastest mode
            assert h["critic_recompute"] == "none" and \
                h["predicted_memory_gb"]["critic_train"] > 0, h
        # the warm-up: the critic trains alone at iteration 0, the policy from iteration 1 on
        assert "loss" not in hist[0] and "weight_sync" not in hist[0]["seconds"], hist[0]
        assert all(math.isfinite(h["loss"]) and "kl" in h for h in hist[1:]), hist
        first, init = hist[0], r["init"]
        same = ("reward", "mean_context", "max_context")   # the batch (GAE's returns move
        assert [init[k] for k in same] == [first[k] for k in same]   # with the values, lam < 1)
        assert init["value_mean"] != first["value_mean"], (init, first)
    # the trained critic read back from HF (its head included) scores as from its checkpoint;
    # the trained policy's trunk under a new head does not
    init = results[0]["init"]
    assert abs(inits["value_model"]["value_mean"] - init["value_mean"]) < 1e-6, (inits, init)
    assert abs(inits["value_model"]["value_loss"] - init["value_loss"]) < 1e-6, (inits, init)
    assert abs(inits["causal_lm"]["value_mean"] - init["value_mean"]) > 1e-3, (inits, init)
    assert inits["causal_lm"]["value_mean"] != results[0]["full"][0]["value_mean"]
    for r in results:
        # one fixed batch: 0.366 -> 0.083 -> 0.022 -> 0.013, then about 0.015 (Adam at 3e-3)
        losses = r["fixed_batch"]
        assert losses[0] > losses[1] > losses[2] > losses[3], losses
        assert max(losses[2:]) < 0.1 * losses[0], losses
        # layout.mode=auto: the critic, built in TP2, moves with the context: to the first
        # batch's TRAIN layout (DP2), then to CP2 with the policy as the contexts grow, the
        # values dispatched from the rollout's DP2; with max_staleness=1 tokens one version
        # old train, the critic's values finite
        auto = r["auto"]
        assert [h["staleness_max"] for h in auto] == [0, 1, 1], auto
        assert all(math.isfinite(h["loss"]) for h in auto[1:]), auto
        assert [h["critic_layout"] for h in auto] == ["DP2", "CP2", "CP2"], auto
        assert all(h["critic_layout"] == h["layouts"]["train"] for h in auto), auto
        assert auto[0]["max_context"] < auto[1]["max_context"], auto
        # (at k=1 the selector keeps iteration 0 in DP2)
        assert [h["layouts"] for h in auto[1:]] == \
            [{"rollout": "DP2", "logprob": "CP2", "train": "CP2"}] * 2, auto
        for h in auto:
            assert all(math.isfinite(h[key]) for key in VALUE_KEYS) and h["value_loss"] > 0, h
            # CRITIC TRAIN's own plan keeps it within the 0.015 GB budget (less the 10% margin)
            assert h["critic_recompute"] in ("none", "selective", "full"), h
            assert 0 < h["predicted_memory_gb"]["critic_train"] <= 0.015 * 0.9, h
        assert r["auto_equal"], "auto, k=1: 2 iterations resumed to 3 differ from 3"
        sw = r["switches"]
        assert sw["equal"] and sw["lengths"] == [19 + 5 * s for s in sw["ids"]], sw
        assert r["warmed"] == (True, True), r["warmed"]   # the warmed trunk, not the seed's
        changed = r["changed"]
        assert any(k.startswith("output_layer.") for k in changed), sorted(changed)
        assert changed and all(changed.values()), sorted(k for k, v in changed.items() if not v)
