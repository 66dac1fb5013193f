"""Switching a mixture-of-experts model moves its experts and their Adam state, bit-exact.

One launch on 4 gloo ranks, tiny qwen3_moe (4 layers, 4 experts of width 32, top 2, aux loss
on), Megatron's distributed optimizer (each expert's Adam state sharded over its edp ranks,
dense state over dp) and, for contrast, the plain one. Per optimizer:

- reference: 3 train_steps on EP1 (DP4), without a switch;
- switched: 2 train_steps on EP1 (Adam state non-trivial), then the chain
  EP1 -> EP2 -> EP2xTP2 -> EP1 -> EP2xTP2 -> EP2 -> EP1 (EP2xTP2: experts split over etp = 2,
  attention under sequence parallelism). After every hop the full weights and the full fp32
  ``exp_avg`` / ``exp_avg_sq`` (gathered from every rank's flat ranges, whatever the layout)
  and the step count equal the reference's after 2 steps bit for bit; then one more step on
  EP1 gives the reference's third loss within 1e-5.
"""

import pytest

from earl_megatron.testing.multiproc import run_distributed

WORLD = 4
SEQ, GLOBAL_BATCH, MBS = 16, 8, 1
CHAIN = ["dp4", "ep2", "ep2xtp2", "dp4", "ep2xtp2", "ep2", "dp4"]


def _full_state(mol):
    """({global name: full weight}, {(global name, kind): full fp32 state}, step), every rank
    contributing its local tensors and flat state ranges (collective)."""
    import torch
    import torch.distributed as dist

    from earl_megatron.models.sharding import unshard
    from earl_megatron.plan.tensor_table import tensor_table
    from earl_megatron.runtime.optimizer_state import optimizer_state

    cfg, lay, me = mol.cfg, mol.layout, dist.get_rank()
    table = tensor_table(cfg)
    state, ranges, step = optimizer_state(mol)
    mine = {}
    for local, p in mol.module().named_parameters():
        row = table.row(table.global_name_on(local, lay, me))
        if row.tied_to:
            continue
        k = row.tp_rank_of(lay, me)
        mine[row.name] = (k, row.tp_of(lay), p.detach().clone(),
                          {kind: t.clone() for kind, t in state.get(local, {}).items()},
                          ranges.get(local))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    weights, local_state = {}, {}
    for part in parts:
        for name, (k, tp, w, st, rng) in part.items():
            weights.setdefault(name, {})[k] = (tp, w)
            for kind, flat in st.items():
                shape, a, b = rng
                buf = local_state.setdefault((name, kind), {}).setdefault(
                    k, torch.full((torch.Size(shape).numel(),), float("nan")))
                buf[a:b] = flat
    full_w = {n: unshard(table.row(n), [by[k][1] for k in sorted(by)]) for n, by in
              weights.items()}
    full_s = {}
    for (n, kind), by in local_state.items():
        shape = weights[n][0][1].shape
        full_s[(n, kind)] = unshard(table.row(n), [by[k].view(shape) for k in sorted(by)])
    assert all(len(by) == by[0][0] for by in weights.values())   # every tp shard present
    return full_w, full_s, None if step is None else float(step)


def _job():
    import torch

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import local_microbatches, random_batch, train_step
    from earl_megatron.runtime.switcher import SwitchStats, switch_layout

    cfg = ModelConfig.tiny("qwen3_moe")
    ref = reference_weights(cfg, seed=13)
    batches = [random_batch(GLOBAL_BATCH, SEQ, cfg.vocab_size, seed=30 + i) for i in range(3)]
    lay = lambda s: ParallelLayout.parse(s, WORLD, cfg)

    def step(mol, batch):
        mbs = local_microbatches(batch, mol.layout, mol.coords, MBS, model=cfg)
        return train_step(mol, mbs, seq_len=SEQ, micro_batch_size=MBS).loss

    out = {}
    with cpu_backend():
        for distributed in (True, False):
            spec = OptimizerSpec(lr=3e-3, weight_decay=0.01,
                                 use_distributed_optimizer=distributed)
            mol = build_on_layout(cfg, lay(CHAIN[0]), weights=ref, optimizer=spec)
            base = [step(mol, b) for b in batches[:2]]
            w0, s0, step0 = _full_state(mol)
            base.append(step(mol, batches[2]))
            mol = build_on_layout(cfg, lay(CHAIN[0]), weights=ref, optimizer=spec)
            losses = [step(mol, b) for b in batches[:2]]
            hops = []
            for name in CHAIN[1:]:
                stats = SwitchStats()
                mol = switch_layout(mol, lay(name), bucket_bytes=8 << 10, stats=stats)
                w, s, st = _full_state(mol)
                hops.append((str(stats.plan.src), str(mol.layout),
                             w.keys() == w0.keys() and all(torch.equal(w[k], w0[k]) for k in w0),
                             s.keys() == s0.keys() and all(torch.equal(s[k], s0[k]) for k in s0),
                             st == step0, stats.plan.bytes_moved, stats.state_bytes_moved,
                             sorted({k for _, k in s})))
            losses.append(step(mol, batches[2]))
            out[distributed] = (base, losses, hops,
                                sum(int(v.abs().sum() > 0) for (_, k), v in s0.items()
                                    if k == "exp_avg" and ".local_experts." in _))
    return out


@pytest.fixture(scope="module")
def job():
    return run_distributed(_job, WORLD, timeout=600, collective_timeout_s=180)[0]


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed_adam", "plain_adam"])
def test_experts_and_adam_state_move_bit_exact_and_training_continues(job, distributed):
    base, losses, hops, nonzero_expert_moments = job[distributed]
    assert [h[1] for h in hops] == ["EP2xDP4", "EP2xTP2xDP2", "DP4", "EP2xTP2xDP2", "EP2xDP4",
                                    "DP4"]
    # Adam state is non-trivial: every expert's fc1 / fc2 of every layer has moments
    assert nonzero_expert_moments == 4 * 4 * 2
    for src, dst, weights_exact, state_exact, step_equal, moved, state_moved, kinds in hops:
        assert weights_exact, (src, dst)
        assert state_exact, (src, dst)
        assert step_equal, (src, dst)
        assert kinds == ["exp_avg", "exp_avg_sq"]
    # EP1 -> EP2 only drops experts; EP2 -> EP2xTP2 and back to DP4 move rows (and state)
    assert hops[0][5] == 0 and hops[1][5] > 0 and hops[2][5] > 0
    assert hops[2][6] > 0
    assert losses[:2] == base[:2]
    assert abs(losses[2] - base[2]) < 1e-5, (base, losses)
    assert base[2] != base[1]
