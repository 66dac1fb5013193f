"""PPO's critic moved between layouts by the switcher (runtime/switcher.py), on 2 gloo ranks.

The critic's value head is a row of the tensor table (``ModelConfig.value_head``), so the
switcher moves it, and its Adam state, like any tensor. One Qwen2 critic (qkv bias; 2 layers)
takes one CRITIC TRAIN step on DP2 (so Adam's moments are not zero), then goes around the chain
DP2 -> TP2 -> PP2 -> CP2 -> DP2 by ``switch_layout``, with the plain and with the distributed
optimizer:

  (a) after every hop its values (runtime/step.forward_values) equal DP2's within 1e-5, per
      [sample, position], and its head and every trunk tensor are DP2's bit for bit;
  (b) back on DP2 the values are DP2's bit for bit, and so are both Adam moments of every
      tensor (the head's included) and the step count;
  (c) one more CRITIC TRAIN step after the round trip gives the values, after it, of the same
      step on a critic that never moved (1e-6): Adam carries on from the moved moments; the
      same step with the moments zeroed (negative control) visibly does not.
"""

import pytest

from earl_megatron.testing.multiproc import run_distributed

GLOBAL_BATCH, SEQ, MBS, VOCAB = 4, 16, 1, 64
CHAIN = ("dp2", "tp2", "pp2", "cp2", "dp2")


def _values(mol, batch):
    """[B, S] float64 values of the whole batch (each rank's slots summed over the world)."""
    import torch
    import torch.distributed as dist

    from earl_megatron.models.cp_attention import zigzag_positions
    from earl_megatron.runtime.step import forward_values, local_microbatches

    lay, c = mol.layout, mol.coords
    per_mb = forward_values(mol, local_microbatches(batch, lay, c, MBS, model=mol.cfg),
                            seq_len=SEQ, micro_batch_size=MBS)
    full = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.float64)
    if per_mb and c.tp == 0:
        per_dp = GLOBAL_BATCH // lay.dp
        rows = torch.arange(c.dp * per_dp, (c.dp + 1) * per_dp)
        full[rows[:, None], zigzag_positions(SEQ, lay.cp, c.cp)[None, :]] = \
            torch.cat(per_mb).double()
    dist.all_reduce(full)
    return full


def _step(mol, batch, *, zero_moments=False):
    """One CRITIC TRAIN step (clipped value loss)."""
    from earl_megatron.rl.value import value_loss
    from earl_megatron.runtime.optimizer_state import megatron_optimizers
    from earl_megatron.runtime.step import local_microbatches, train_step_values

    if zero_moments:   # negative control: the moved moments lost
        for opt in megatron_optimizers(mol.optimizer):
            for state in opt.optimizer.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in state:
                        state[k].zero_()
    train_step_values(
        mol, local_microbatches(batch, mol.layout, mol.coords, MBS, model=mol.cfg),
        seq_len=SEQ, micro_batch_size=MBS,
        loss_fn=lambda v, mb: value_loss(v, mb["old_values"], mb["returns"], mb["loss_mask"],
                                         clip=0.2))


def _job():
    import torch
    import torch.distributed as dist

    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.models.value_model import critic_config, critic_loader
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.optimizer_state import MOMENTS
    from earl_megatron.runtime.step import TokenBatch, random_batch
    from earl_megatron.runtime.switcher import switch_layout
    from earl_megatron.testing.optimizer_check import gathered_state
    from earl_megatron.testing.tiny_models import tiny_model
    from earl_megatron.weights.gather import gather_full

    policy = tiny_model("qwen2", vocab_size=VOCAB, num_layers=2)
    cfg = critic_config(policy)
    weights = reference_weights(policy, seed=7)
    b = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=3)
    g = torch.Generator().manual_seed(5)
    batch = TokenBatch(tokens=b.tokens, loss_mask=b.loss_mask, extras={
        "returns": torch.randn(GLOBAL_BATCH, SEQ + 1, generator=g) * 0.3,
        "old_values": torch.randn(GLOBAL_BATCH, SEQ + 1, generator=g) * 0.1})
    world = dist.get_world_size()
    out = {}
    with cpu_backend():
        for distributed in (False, True):
            spec = OptimizerSpec(lr=1e-3, use_distributed_optimizer=distributed)

            def fresh():
                lay = ParallelLayout.parse(CHAIN[0], world_size=world, model=cfg)
                mol = build_on_layout(cfg, lay, load=critic_loader(weights, cfg, lay),
                                      optimizer=spec, seed=11)
                _step(mol, batch)
                return mol

            mol = fresh()
            start = {"values": _values(mol, batch),
                     "params": gather_full(mol.model, cfg, mol.layout),
                     "state": gathered_state(mol)[0]}
            hops = []
            for name in CHAIN[1:]:
                mol = switch_layout(mol, ParallelLayout.parse(name, world_size=world, model=cfg))
                params = gather_full(mol.model, cfg, mol.layout)
                hops.append({"layout": str(mol.layout),
                             "values": (_values(mol, batch) - start["values"]).abs().max().item(),
                             "params": params.keys() == start["params"].keys() and all(
                                 torch.equal(params[k], start["params"][k]) for k in params)})
            back = {"values": torch.equal(_values(mol, batch), start["values"])}
            state = gathered_state(mol)[0]
            back["state"] = {k: state[k].keys() == start["state"][k].keys() and all(
                torch.equal(t, start["state"][k][n]) for n, t in state[k].items())
                for k in MOMENTS}
            back["head_in_state"] = "output_layer.weight" in state[MOMENTS[0]] and \
                state[MOMENTS[0]]["output_layer.weight"].abs().sum().item() > 0
            after = {}
            for key, critic, zero in (("moved", mol, False), ("unmoved", fresh(), False),
                                      ("control", fresh(), True)):
                _step(critic, batch, zero_moments=zero)
                after[key] = _values(critic, batch)
            back["after_step"] = (after["moved"] - after["unmoved"]).abs().max().item()
            back["control"] = (after["control"] - after["unmoved"]).abs().max().item()
            out[distributed] = {"hops": hops, "back": back}
    return out


@pytest.fixture(scope="module")
def job():
    return run_distributed(_job, 2, timeout=400, collective_timeout_s=120)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain_adam", "distributed_adam"])
def test_the_critic_switches_bit_exactly(job, distributed):
    for rank in job:
        r = rank[distributed]
        assert [h["layout"] for h in r["hops"]] == ["TP2", "PP2", "CP2", "DP2"]
        for h in r["hops"]:   # (a)
            assert h["params"], h["layout"]
            assert h["values"] < 1e-5, h
        back = r["back"]   # (b)
        assert back["values"] and all(back["state"].values()), back
        assert back["head_in_state"]
        assert back["after_step"] < 1e-6 < 1e-4 < back["control"], back   # (c)
