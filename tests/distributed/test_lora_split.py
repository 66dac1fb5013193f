"""A LoRA run on split placement (3 gloo ranks): train pool TP2 (ranks 0-1), rollout pool rank 2
in DP1, the embedded engine, k = 1, adapters of rank 4 on every linear.

The first handoff gives the rollout pool the whole model; the base is frozen, so every later
handoff moves the adapters alone (trainer/handoff.py, ``plan_weights(adapters_only=True)``).
Checked: after every handoff both pools' full weights (base and adapters) hash equal, so the
rollout side decodes with the trained adapters over the same base; each later meeting's busiest
rank received exactly the adapters' bytes, far below the model's; every episode handed over was
trained exactly once; and the adapters did change.
"""

from split_audit import check_exactly_once, check_handoffs, read_audit, split_config, \
    train_audited

from earl_megatron.testing.multiproc import run_distributed


def test_lora_split_hands_off_the_adapters_alone(tmp_path):
    from earl_megatron.plan.tensor_table import tensor_table

    cfg = split_config(str(tmp_path / "run"), 3, 1, checkpoint_every=0)
    d = cfg.to_dict()
    d["model"]["lora"] = {"rank": 4, "alpha": 8.0}
    d["layout"].update(train="tp2", logprob="tp2", rollout="dp1")
    d["rollout"]["pool_ranks"] = 1
    cfg = type(cfg).from_dict(d)
    audit = tmp_path / "audit"
    hist = run_distributed(train_audited, 3, cfg, str(audit), timeout=600)[0]
    assert [h["iteration"] for h in hist] == [0, 1, 2]

    rows = read_audit(audit)
    check_exactly_once(rows, 3)
    weights = check_handoffs(rows)   # base and adapters equal on both pools after each
    assert sorted(weights) == [0, 1, 2], sorted(weights)
    assert any(weights[j]["train"] != weights[j - 1]["train"] for j in (1, 2))

    table = tensor_table(cfg.model)
    adapters = sum(r.numel for r in table.full_rows if r.adapter) * 4   # fp32
    model = sum(r.numel for r in table.full_rows) * 4
    assert 0 < adapters < model / 5, (adapters, model)
    for h in hist[1:]:   # iteration 0's record holds no handoff (the start's is in begin)
        assert h["split"]["handoff_bytes"] == adapters, (h["split"], adapters, model)
        assert h["layouts"] == {"rollout": "TP1", "logprob": "TP2", "train": "TP2"}
        assert h["staleness_max"] <= 1 and h["pool_dropped"] == 0


def test_lora_auto_moves_between_split_and_colocated(tmp_path):
    """auto placement with adapters (auto's decisions forced, split_audit.train_scheduled): a
    split of 1 rollout rank, colocated at meeting 2, a split again before stage 4; each move goes
    through a checkpoint holding base and adapters. Every episode sent trains exactly once and
    after every handoff both pools' weights hash equal."""
    from split_audit import train_scheduled

    from earl_megatron.config.train import TrainConfig

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
    assert len(check_handoffs(rows)) >= 2
    for h in hist:
        assert h["staleness_max"] <= 1 and h["pool_dropped"] == 0
