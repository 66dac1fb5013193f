"""A LoRA run on split and auto placement (3 gloo ranks, the embedded engine, k = 1, adapters of
rank 4 on every linear; auto's decisions forced by split_audit.train_scheduled): a split of 1
rollout rank for iterations 0-1, colocated for 2-3 (moved at meeting 2 through a checkpoint
holding base and adapters), a split again for 4.

The first handoff of every pair of pools gives the rollout pool the whole model; the base is
frozen, so every later handoff moves the adapters alone (trainer/handoff.py,
``plan_weights(adapters_only=True)``). Checked: after every handoff both pools' full weights
(base and adapters) hash equal, so the rollout side decodes with the trained adapters over the
same base; meeting 1's busiest rank received exactly the adapters' bytes, far below the
model's; every episode sent was trained exactly once; and the adapters did change.
"""

from split_audit import check_exactly_once, check_handoffs, read_audit, train_scheduled

from earl_megatron.testing.multiproc import run_distributed


def test_lora_split_and_auto_hand_off_the_adapters_alone(tmp_path):
    from earl_megatron.config.train import TrainConfig
    from earl_megatron.plan.tensor_table import tensor_table

    out, audit = tmp_path / "run", tmp_path / "audit"
    cfg = TrainConfig.from_dict({
        "model": {"vocab_size": 32, "lora": {"rank": 4, "alpha": 8.0}},
        "layout": {"mode": "auto"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": []},
        "rollout": {"episodes_per_iteration": 6, "max_turns": 4, "placement": "auto"},
        "algorithm": {"name": "grpo", "group_size": 2, "micro_batch_size": 2,
                      "max_staleness": 1},
        "run": {"iterations": 5, "output_dir": str(out), "eval_episodes": 2,
                "live_view": False, "checkpoint_every": 0},
    })
    hist = run_distributed(train_scheduled, 3, cfg, str(audit), [1, 1, 0, 0, 1],
                           timeout=600)[0]
    where = [h["split"]["rollout_ranks"] if "split" in h else 0 for h in hist]
    assert where == [1, 1, 0, 0, 1], where
    rows = read_audit(audit)
    check_exactly_once(rows, 5, per_batch=6)
    weights = check_handoffs(rows)   # base and adapters equal on both pools after each
    assert sorted(weights) == [0, 1, 4], sorted(weights)
    assert any(h["grad_norm"] > 0 for h in hist[:4])   # so the adapters changed by meeting 4
    assert weights[4]["train"] != weights[0]["train"]

    table = tensor_table(cfg.model)
    adapters = sum(r.numel for r in table.full_rows if r.adapter) * 4   # fp32
    model = sum(r.numel for r in table.full_rows) * 4
    assert 0 < adapters < model / 5, (adapters, model)
    # meeting 1 (the first pools' second handoff) moved the adapters alone; iteration 0's
    # and 4's records hold none (a pair of pools' first handoff runs before its first stage)
    assert hist[1]["split"]["handoff_bytes"] == adapters, (hist[1]["split"], adapters, model)
    for h in hist:
        assert h["staleness_max"] <= 1 and h["pool_dropped"] == 0
