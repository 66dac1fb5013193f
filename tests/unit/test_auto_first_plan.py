"""auto's first placement (trainer/auto.py ``Auto.propose``, rank 0's decision, one process):
colocated while nothing is measured, then what the measured rates say; a split run (placement
split with auto layouts) never plans colocated."""

from types import SimpleNamespace

from earl_megatron.plan.split import MeasuredRates, scored_rates
from earl_megatron.testing.configs import tiny_connect_four
from earl_megatron.trainer.auto import Auto
from earl_megatron.trainer.planner import StagePlanner
from earl_megatron.trainer.stages import BatchShape


def _auto(tmp_path, colocated=True) -> Auto:
    cfg = tiny_connect_four(str(tmp_path), layout={"mode": "auto"},
                            rollout={"placement": "auto" if colocated else "split"},
                            algorithm={"max_staleness": 1}, run={"iterations": 8})
    a, r = cfg.algorithm, cfg.rollout
    planner = StagePlanner(cfg.model, cfg.layout, cfg.cluster, 3,
                           distributed_optimizer=a.use_distributed_optimizer,
                           episodes=r.episodes_per_iteration,
                           batch=BatchShape(a.micro_batch_size, a.micro_batch_tokens),
                           prefill_tokens=r.prefill_tokens, in_flight=16)
    return Auto(SimpleNamespace(planner=planner, cfg=cfg, saved=-1), colocated=colocated)


def test_colocated_first_then_the_measured_rates_decide(tmp_path):
    auto = _auto(tmp_path)
    first = auto.propose([], None)
    assert first.colocated and first.reason.startswith("colocated first: nothing measured")
    auto.plan = first
    lengths = [90] * 8
    wp = auto.planner
    wp.last_lengths = lengths
    work = wp.split_workload(0.0)
    colo = auto.propose(lengths, None)     # the model's own numbers, for scale
    # the first stage waited on its environments as long as the whole iteration computes,
    # scoring took the model's time: a split overlaps that wait with the train step
    env = colo.period_s
    waited = scored_rates(wp.selector, wp.split_workload(env), env + colo.rollout_s,
                          colo.logprob.chosen.cost, sum(lengths))
    moved = auto.propose(lengths, waited, env)
    assert not moved.colocated, moved.reason
    # no waiting and a scoring forward 3x the model's: the train side dominates, stay
    heavy = scored_rates(wp.selector, work, colo.rollout_s, 3 * colo.logprob.chosen.cost,
                         sum(lengths))
    kept = auto.propose(lengths, heavy, 0.0)
    assert kept.colocated, kept.reason


def test_a_split_run_never_plans_colocated(tmp_path):
    auto = _auto(tmp_path, colocated=False)
    first = auto.propose([], None)
    assert not first.colocated and "split" in first.reason
    rates = MeasuredRates(first.rollout_ranks, 0.1, 720, 5.0, 720)
    assert not auto.propose([90] * 8, rates).colocated
