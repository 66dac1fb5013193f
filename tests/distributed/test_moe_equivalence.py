"""Mixture of experts: same seed, data and weights give the same loss and full gradients on
every layout as the one-process run (tiny qwen3_moe, 4 experts, top 2, dropless routing).

One launch per world size, looping over layouts (regrouping in place): world 4 runs DP4, EP2,
EP4, TP2xDP2, EP2xTP2xDP2, EP2xTP2xDP2xETP1, PP2xDP2, EP2xPP2xDP2, CP2xDP2, EP2xCP2xDP2;
world 2 runs EP2 and TP2 (tp > 1: sequence parallelism, required by Megatron's MoE layer).

The load-balancing aux loss is ON (coefficient 0.1, large enough that its gradient is ~10% of
the router's: the check below fails without the step's correction). It is layout-invariant
here because of how Megatron computes it and how runtime/step.py scales it:
- Megatron's "aux_loss" is per micro-batch: the token counts per expert are summed over the
  tp x cp group (the whole micro-batch's sequence, whatever SP or CP cut), each rank adding
  its own tokens' router probabilities. Every layout here cuts the same micro-batches (one
  sample each: the global batch is split over dp, never inside a sample), so each micro-batch's
  aux loss is the same number. EP does not change which tokens a rank routes (routing happens
  before dispatch). The "seq_aux_loss" / "global_aux_loss" types would be invariant too, but
  the second accumulates counts across calls (its state must be reset by the caller).
- Its gradient scale is not, as Megatron leaves it under ``calculate_per_token_loss``: the
  router multiplies each rank's part by the rank's *local* token count (seq / (tp * cp)) while
  finalize_model_grads divides by the global masked-token count, so the aux gradient shrinks
  by tp * cp. runtime/step.py scales it back (``_aux_loss_scale``); with that, TP2 and CP2
  match the one-process run like every other layout.
Dropless routing (no capacity factor) keeps every token: the result is deterministic.
"""

import functools

import pytest

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-5
GLOBAL_BATCH, SEQ, MBS = 8, 32, 1
AUX = 0.1

LAYOUTS = {
    2: ["ep2", "tp2"],
    4: ["dp4", "ep2", "ep4", "tp2", "ep2xtp2", "ep2,tp2,etp1", "pp2", "ep2xpp2", "cp2",
        "ep2xcp2"],
}


def _run_layouts(layout_names, aux):
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import (
        forward_backward,
        local_microbatches,
        random_batch,
    )
    from earl_megatron.weights.gather import gather_full

    cfg = ModelConfig.tiny("qwen3_moe", moe_aux_loss_coeff=aux)
    weights = reference_weights(cfg, seed=7)
    batch = random_batch(GLOBAL_BATCH, SEQ, cfg.vocab_size, seed=3)
    out = {}
    with cpu_backend():
        for name in layout_names:
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
            mol = build_on_layout(cfg, lay, weights=weights)
            mbs = local_microbatches(batch, lay, mol.coords, MBS, model=cfg)
            res = forward_backward(mol.model, mol.tcfg, mbs, lay, seq_len=SEQ,
                                   micro_batch_size=MBS)
            grads = gather_full(mol.model, cfg, lay, what="grad")
            groups.destroy_groups()
            if dist.get_rank() == 0:
                out[str(lay)] = (res.loss, res.num_tokens, grads)
    return out if dist.get_rank() == 0 else None


@functools.cache
def _reference(aux):
    return run_distributed(_run_layouts, 1, ["tp1"], aux)[0]["TP1"]


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_aux_loss_gradient_is_large_enough_to_matter():
    """The aux loss's share of the router gradient is far above the tolerance (else the
    layout check below would not see a wrong aux scale)."""
    _, _, with_aux = _reference(AUX)
    _, _, without = _reference(0.0)
    routers = [k for k in with_aux if k.endswith("mlp.router.weight")]
    assert len(routers) == 4
    diff = max((with_aux[k] - without[k]).abs().max().item() for k in routers)
    assert diff > 100 * TOL, diff


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_loss_and_grads_match_one_process(world):
    ref_loss, ref_tokens, ref_grads = _reference(AUX)
    results = run_distributed(_run_layouts, world, LAYOUTS[world], AUX, timeout=400,
                              collective_timeout_s=180)[0]
    assert len(results) == len(LAYOUTS[world])
    for lay, (loss, ntok, grads) in results.items():
        assert ntok == ref_tokens, lay
        assert abs(loss - ref_loss) < TOL, (lay, loss, ref_loss)
        assert grads.keys() == ref_grads.keys(), (lay, set(grads) ^ set(ref_grads))
        for name, g in grads.items():
            diff = (g - ref_grads[name]).abs().max().item()
            assert diff < TOL, (lay, name, diff)
        print(f"{lay}: loss diff {abs(loss - ref_loss):.1e}, max grad diff "
              f"{_max_diff(grads, ref_grads):.1e}")
        experts = [g for k, g in grads.items() if ".local_experts." in k]
        assert len(experts) == 4 * 4 * 2 and all(g.abs().sum() > 0 for g in experts), lay
