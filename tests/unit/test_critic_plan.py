"""PPO's critic in the planners: plan/critic_memory.py counts and places it once for both the
trainer (trainer/planner.py) and ``earl plan --critic`` (tools/plan_layouts.py)."""

import io
from dataclasses import replace

import pytest
from test_plan_layouts_cli import tool  # noqa: F401 - the fixture loading tools/plan_layouts.py

from earl_megatron.plan.critic_memory import (FIRST_ROLLOUT_TOKENS, critic_plan, held_bytes,
                                              train_bytes, weight_bytes)
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import train_state_bytes
from earl_megatron.plan.selector import RECOMPUTE_ORDER, NoLayoutFitsError
from earl_megatron.plan.specs import (GiB, Recompute, Stage, StageWorkload, TrainOptions,
                                      human_bytes)
from earl_megatron.plan.tensor_table import num_parameters
from earl_megatron.testing.configs import tiny_connect_four


def test_the_tool_places_and_counts_the_critic_as_the_trainer_does(tmp_path, tool):
    from earl_megatron.trainer.planner import StagePlanner
    from earl_megatron.trainer.stages import BatchShape

    cfg = tiny_connect_four(str(tmp_path), algorithm={"name": "ppo"},
                            layout={"mode": "auto", "memory_budget_gb": 0.015})
    p = StagePlanner(cfg.model, cfg.layout, cfg.cluster, 2, distributed_optimizer=False,
                     episodes=8, batch=BatchShape(1))
    opts = p.selector.train_opts
    one = ParallelLayout.parse("dp2", world_size=2, model=cfg.model)
    # a whole replica per rank: every parameter (the tiny model is fp32: 4 bytes each, 152,128
    # parameters), then its grads and Adam state on top
    assert weight_bytes(cfg.model, one, opts) == num_parameters(cfg.model) * 4 == 608_512
    assert train_bytes(cfg.model, one, opts) == 608_512 + train_state_bytes(cfg.model, one, opts)
    assert p.train_bytes(one) == train_bytes(cfg.model, one, opts)

    first = p._workload("train", [FIRST_ROLLOUT_TOKENS] * 8)
    chosen = critic_plan(p.selector, first)   # where the critic is built: 8 x 128 tokens
    assert chosen.layout == p.critic_choice() == tool.critic_layout(p.selector, first)
    # the policy's train state in the critic's own layout, counted beside it
    assert chosen.chosen.memory.resident == p.train_bytes(chosen.layout) > 0
    assert "in each candidate's own layout" in chosen.reason

    # the critic moves with each batch's TRAIN layout: TRAIN counts it in each candidate's own
    # layout, every other stage where it is (the last TRAIN's); the run's state restores it
    p = StagePlanner(cfg.model, cfg.layout, cfg.cluster, 2, distributed_optimizer=False,
                     episodes=8, batch=BatchShape(1), critic=True)
    p.critic_layout = p.critic_choice()
    wheres = []
    for n in (64, 512):
        train = p.plan("train", [n] * 8, p.critic_layout)
        beside = critic_plan(p.selector, p._workload("train", [n] * 8))   # the mirror rule
        assert train == beside.layout and p.predicted_memory["train"] == \
            beside.predicted_memory_bytes, n
        p.critic_layout = train   # trainer/critic.py: the critic moves there
        p.plan("logprob", [n] * 8, None)
        alone = p.selector.memory(p.state.previous(Stage.LOGPROB),
                                  p._workload("logprob", [n] * 8))
        assert p.predicted_memory["logprob"] == alone.total + p.train_bytes(train)
        wheres.append(str(train))
    assert wheres == ["DP2", "TP2"], wheres   # the layout changes with the context
    q = StagePlanner(cfg.model, cfg.layout, cfg.cluster, 2, distributed_optimizer=False,
                     episodes=8, batch=BatchShape(1), critic=True)
    q.restore(p.state_json(), [512] * 8)
    assert str(q.critic_choice()) == "TP2"   # a resumed run builds it where it was

    # a LoRA policy: its critic is a full model (the base's), counted so beside every stage
    # and in CRITIC TRAIN; the policy beside the critic's TRAIN holds its weights too
    lcfg = tiny_connect_four(str(tmp_path), algorithm={"name": "ppo"},
                             model={"vocab_size": 32, "lora": {"rank": 4}},
                             layout={"mode": "auto", "memory_budget_gb": 1.0})
    lp = StagePlanner(lcfg.model, lcfg.layout, lcfg.cluster, 2, distributed_optimizer=False,
                      episodes=8, batch=BatchShape(1))
    lp.critic_layout = one
    lopts = lp.selector.train_opts
    full = held_bytes(lcfg.model.base, one, lopts)
    assert full == train_bytes(lcfg.model.base, one, lopts) > held_bytes(lcfg.model, one, lopts) \
        > train_bytes(lcfg.model, one, lopts)
    lay = lp.plan("logprob", [64] * 8, None)
    plain = lp.selector.memory(lay, lp._workload("logprob", [64] * 8))
    assert lp.predicted_memory["logprob"] == plain.total + full
    lp.critic_train([64] * 8, one)
    wl = lp._workload("train", [64] * 8)
    critic = replace(lp.selector, model=lcfg.model.base).memory(
        one, wl, held_bytes(lcfg.model, one, lopts), Recompute(lp.recompute["critic_train"]))
    assert lp.predicted_memory["critic_train"] == critic.total


def test_earl_plan_critic_on_the_7b_node(tool):
    argv = ["--model", "qwen2.5-7b", "--contexts", "1024,32768", "--responses", "64",
            "--micro-batch-tokens", "16384", "--stages", "train"]
    args = tool.build_parser().parse_args(argv)
    model = tool.model_from_args(args)
    out = io.StringIO()
    assert tool.main(argv + ["--critic"], out=out) == 0
    text = out.getvalue()
    assert "; ppo: a critic of the policy's shape" in " ".join(text.split())  # (wrapped)
    assert "train, ppo (64 sequences per context)" in text
    assert text.count(" policy: train ") == 2 and text.count(" critic: train ") == 2

    opts = TrainOptions(distributed_optimizer=True)
    selector = tool.Selector(model, tool.cluster_from_args(args), opts,
                             tool.SelectorConfig(auto_recompute=True))
    critic = tool.critic_layout(selector, tool._workload(Stage.TRAIN, 1024, 64, 16384, None))
    state = train_bytes(model, critic, opts)
    for critic_on, resident in ((False, 0), (True, state)):
        grid = tool.plan_grid(selector, [Stage.TRAIN], [1024], [64], 16384, critic=critic_on)
        assert grid[(Stage.TRAIN, 1024, 64)].chosen.memory.resident == resident

    rows = tool.critic_rows(model, args, opts, selector.config, 64)
    # docs/algorithms.md: the 7B trains on 4 GPUs alone, on the node's 8 with a critic
    assert [r["alone_fewest"][0] for r in rows] == [4, 4]
    assert [r["with_fewest"][0] for r in rows] == [8, 8]
    assert rows[0]["with"]["critic"] == critic and rows[0]["with"]["resident"] == state

    # a LoRA policy (rank 8) beside a full critic: the policy alone trains 1K on 1 GPU, with
    # the critic (every parameter trained, counted as the base: critic_model) on 4; the
    # critic's resident state is the full model's either way
    lora_args = tool.build_parser().parse_args(argv + ["--lora-rank", "8"])
    lora = tool.model_from_args(lora_args)
    lrows = tool.critic_rows(lora, lora_args, opts, selector.config, 64)
    assert [r["alone_fewest"][0] for r in lrows] == [1, 4]
    assert [r["with_fewest"][0] for r in lrows] == [4, 8]
    lcritic = lrows[0]["with"]["critic"]
    assert lrows[0]["with"]["resident"] == held_bytes(lora.base, lcritic, opts) > \
        train_bytes(lora, lcritic, opts)
    # the critic moves with the context: TP4xCP2 at 1K, TP2xCP2xPP2 at 32K (docs/algorithms.md)
    assert [str(r["with"]["critic"]) for r in rows] == ["TP4xCP2", "TP2xCP2xPP2"]
    assert tool.main(argv + ["--critic", "--lora-rank", "8"], out=io.StringIO()) == 0
    # SGLang servers beside the trainer: a server's static pool is its fraction of the device
    # less what the device holds at its start, the critic's resident train state included, so
    # the 7B's rollout with a critic needs a larger fraction than without one
    for fraction, fits in ((0.3, False), (0.8, True)):
        engine = tool.DecodeEngine.sglang_servers(fraction)
        sel = tool.Selector(model, tool.cluster_from_args(args).with_(decode_engine=engine),
                            opts, tool.SelectorConfig(auto_recompute=True))
        grid = tool.plan_grid(sel, [Stage.ROLLOUT], [1024], [64], 16384, decode_fraction=0.5,
                              critic=True)
        plan = grid[(Stage.ROLLOUT, 1024, 64)]
        assert (not isinstance(plan, Exception)) == fits, (fraction, plan)
        plain = tool.plan_grid(sel, [Stage.ROLLOUT], [1024], [64], 16384, decode_fraction=0.5)
        assert not isinstance(plain[(Stage.ROLLOUT, 1024, 64)], Exception), fraction
    assert tool.main(argv[:-2] + ["--stages", "rollout", "--critic", "--sglang-mem-fraction",
                                  "0.8"], out=io.StringIO()) == 0
    # --split: the critic trains where the policy trains, counted in the train pool's plan:
    # 4 GPUs train the 7B's policy (TP4, 46 GiB) but not policy and critic (TP4: 78 GiB)
    plain, ppo = (tool.split_rows(selector, [1024], [8], 16384, "4", 0.0, critic=c)[0]
                  for c in (False, True))
    assert str(plain["split"].train.layout) == "TP4"
    assert "the train pool of 4 ranks: no layout fits stage train" in str(ppo["split"])


def test_the_critic_is_placed_with_the_policy_laid_out_like_each_candidate(tool):
    """The 72B recipe's 16 nodes, TRAIN of 64 sequences of 4K tokens (32K-token micro-batches,
    recompute auto): the old rule (the first choice alone, its policy state then counted
    resident beside every candidate) finds nothing; counted in each candidate's own layout,
    policy and critic both fit in TP2xCP4xPP16 with full recompute."""
    args = tool.build_parser().parse_args(["--model", "qwen2.5-72b", "--nodes", "16",
                                           "--gpus-per-node", "8"])
    model, opts = tool.model_from_args(args), TrainOptions(distributed_optimizer=True)
    sel = tool.Selector(model, tool.cluster_from_args(args), opts,
                        tool.SelectorConfig(auto_recompute=True))
    wl = StageWorkload.of(Stage.TRAIN, 4096, 64, micro_batch_tokens=32768)

    # the old rule: the first choice alone spreads the policy's state less than any layout
    # that could hold both, and with that one value resident nothing fits
    alone = sel.plan(wl)[0].layout
    assert sel.fits_somewhere(wl, train_bytes(model, alone, opts)) is None
    with pytest.raises(NoLayoutFitsError):
        sel.plan(wl, resident_bytes=train_bytes(model, alone, opts))

    # from first principles: every (layout, mode) with the policy's state in that layout,
    # ranked by cost, then mode, memory and layout
    fitting = []
    for lay in sel.valid_layouts(Stage.TRAIN):
        resident = train_bytes(model, lay, opts)
        for rc in RECOMPUTE_ORDER:
            mem = sel.memory(lay, wl, resident, rc)
            if sel.fits(mem):
                c = sel.evaluate(lay, wl, resident_bytes=resident, recompute=rc)
                fitting.append((c.cost, RECOMPUTE_ORDER.index(rc), mem.total, lay, rc, resident))
    best = min(fitting)
    assert (str(best[3]), best[4]) == ("TP2xCP4xPP16", Recompute.FULL)

    plan = critic_plan(sel, wl)
    assert (plan.layout, plan.recompute) == (best[3], best[4])
    assert plan.chosen.memory.resident == best[5] == train_bytes(model, plan.layout, opts)
    assert plan.predicted_memory_bytes == best[2] <= plan.budget_bytes
    assert 23 * GiB < best[5] < 24 * GiB and 59 * GiB < best[2] < 60 * GiB     # 23.6 of 59.9
    assert plan.num_valid == len(sel.valid_layouts(Stage.TRAIN)) == 90
    assert alone in plan.oom and plan.layout not in plan.oom
    assert "policy's train state counted resident in each candidate's own layout" in plan.reason


def test_critic_plan_raises_with_suggestions_checked_under_its_rule(tmp_path):
    """Nowhere to fit: NoLayoutFitsError as Selector.plan raises it, its smallest estimate and
    its suggestion (more nodes) both with the policy's state in the layout they name."""

    from earl_megatron.trainer.planner import StagePlanner
    from earl_megatron.trainer.stages import BatchShape

    cfg = tiny_connect_four(str(tmp_path), algorithm={"name": "ppo"},
                            layout={"mode": "auto", "memory_budget_gb": 0.003})
    sel = StagePlanner(cfg.model, cfg.layout, cfg.cluster, 2, distributed_optimizer=False,
                       episodes=8, batch=BatchShape(1)).selector
    opts = sel.train_opts
    wl = StageWorkload.of(Stage.TRAIN, 128, 8, micro_batch_tokens=128)
    with pytest.raises(NoLayoutFitsError) as e:
        critic_plan(sel, wl)
    small = e.value.smallest
    assert small.total > sel.budget_bytes
    assert small.resident == train_bytes(cfg.model, small.layout, opts) > 0
    # the first suggestion: twice the nodes, a layout there that fits beside its own policy state
    text = e.value.suggestions[0]
    assert text.startswith("2 nodes (4 devices), e.g. ")
    name, at = text.split("e.g. ")[1].split(" at ")
    bigger = replace(sel, cluster=sel.cluster.with_(nodes=2))
    lay = ParallelLayout.parse(name.lower(), world_size=4, model=cfg.model)
    mems = [bigger.memory(lay, wl, train_bytes(cfg.model, lay, opts), rc)
            for rc in bigger.recompute_modes(Stage.TRAIN)]
    assert at in {human_bytes(m.total) for m in mems if bigger.fits(m)}
    with pytest.raises(ValueError, match="TRAIN"):     # the critic is placed for its TRAIN
        critic_plan(sel, StageWorkload.of(Stage.LOGPROB, 128, 8, micro_batch_tokens=128))


def test_critic_train_gets_the_fastest_recompute_mode_that_fits_beside_the_policy(tmp_path):
    """CRITIC TRAIN's recompute mode (StagePlanner.critic_train): the critic's layout fixed,
    the policy's train state in its TRAIN layout resident, the fastest mode whose estimate is
    within the budget; a mode name in layout.recompute fixes it; none fitting is refused."""
    from earl_megatron.plan.what_fits import LayoutOverBudgetError
    from earl_megatron.trainer.planner import StagePlanner
    from earl_megatron.trainer.stages import BatchShape

    lengths = [256] * 8

    def planner(budget_gb, recompute="auto"):
        cfg = tiny_connect_four(str(tmp_path), algorithm={"name": "ppo"},
                                layout={"mode": "auto", "memory_budget_gb": budget_gb,
                                        "recompute": recompute})
        p = StagePlanner(cfg.model, cfg.layout, cfg.cluster, 2, distributed_optimizer=False,
                         episodes=8, batch=BatchShape(4))
        p.critic_layout = ParallelLayout.parse("tp2", world_size=2, model=cfg.model)
        return p

    p = planner(1.0)
    dp2 = ParallelLayout.parse("dp2", world_size=2, model=p.model)
    wl = p._workload("train", lengths)
    resident = p.train_bytes(dp2)   # the policy trains in DP2 this iteration
    mem = {rc: p.selector.memory(p.critic_layout, wl, resident, rc) for rc in Recompute}
    assert all(m.resident == resident for m in mem.values())
    full, none = mem[Recompute.FULL].total, mem[Recompute.NONE].total
    assert full < none, (full, none)   # recomputing holds fewer activations
    assert p.critic_train(lengths, dp2) == "none"   # everything fits: the fastest
    assert p.predicted_memory["critic_train"] == none and p.recompute["critic_train"] == "none"

    # a budget below no-recompute's estimate by half of what the policy's state would shrink
    # in TP2 (its state there is half DP2's): only recomputing fits beside the policy in DP2
    # (budget = memory x (1 - margin))
    tp2_state = p.train_bytes(p.critic_layout)
    assert tp2_state < resident
    margin = p.selector.config.memory_margin
    tight = planner((none - (resident - tp2_state) / 2) / (1 - margin) / GiB)
    fitting = [rc for rc in Recompute if mem[rc].total <= tight.selector.budget_bytes]
    assert Recompute.NONE not in fitting and Recompute.FULL in fitting
    want = min(fitting, key=lambda rc: (
        tight.selector.evaluate(p.critic_layout, wl, resident_bytes=resident,
                                recompute=rc).predicted_seconds, RECOMPUTE_ORDER.index(rc)))
    assert tight.critic_train(lengths, dp2) == want.value != "none"
    # the resident policy state counts: beside the policy in TP2 no-recompute fits again
    assert none - resident + tp2_state <= tight.selector.budget_bytes
    assert tight.critic_train(lengths, p.critic_layout) == "none"

    assert planner(1.0, recompute="selective").critic_train(lengths, dp2) == "selective"
    with pytest.raises(LayoutOverBudgetError):
        planner(full * 0.5 / (1 - margin) / GiB).critic_train(lengths, dp2)
