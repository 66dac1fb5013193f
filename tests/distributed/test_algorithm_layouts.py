"""The algorithm menu's losses are layout-independent: GSPO (sequence and token variants), CISPO
and every loss aggregation give the same loss AND full gradients on TP2, PP2, CP2 and DP2 as on
one process.

The trainer's own loss functions (trainer/stages.py ``_loss_fn``: GSPO's per-episode sums added
over cp chunks, the aggregation's per-token weights) run under Megatron's schedules on one
random batch whose old logprobs sit around the model's own (ratios on both sides of the clip
range) and whose advantages vary within episodes (so gspo and gspo_token differ). Under CP2
each episode's tokens are split over two ranks: a GSPO that summed only its chunk would differ.
One launch per world size; each launch loops over the cases and layouts.
"""

import functools

import pytest

from earl_megatron.testing.multiproc import run_distributed

TOL = 2e-5
GLOBAL_BATCH, SEQ, MBS = 4, 16, 1
CASES = {
    "ppo_clip/seq_mean_token_mean": ("ppo_clip", "seq_mean_token_mean"),
    "ppo_clip/seq_mean_token_sum": ("ppo_clip", "seq_mean_token_sum"),
    "ppo_clip/seq_mean_token_sum_norm": ("ppo_clip", "seq_mean_token_sum_norm"),
    "gspo/seq_mean_token_mean": ("gspo", "seq_mean_token_mean"),
    "gspo_token/seq_mean_token_mean": ("gspo_token", "seq_mean_token_mean"),
    "cispo/token_mean": ("cispo", "token_mean"),
}
LAYOUTS = ["tp2", "pp2", "cp2", "dp2"]


def _batch(vocab: int):
    import math

    import torch

    from earl_megatron.rl.losses import aggregation_weights
    from earl_megatron.runtime.step import TokenBatch

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(GLOBAL_BATCH, SEQ + 1, generator=g) > 0.3).float()
    mask[:, 0] = 0.0
    mask[3, 1:] = 0.0
    mask[3, 9] = 1.0          # an episode with one policy token
    old = -math.log(vocab) + 0.3 * torch.randn(GLOBAL_BATCH, SEQ + 1, generator=g)
    adv = torch.randn(GLOBAL_BATCH, SEQ + 1, generator=g) * mask
    extras = {"old_logprobs": old, "advantages": adv}
    out = {}
    for case, (_, agg) in CASES.items():
        n = {r: float(mask[r, 1:].sum()) for r in range(GLOBAL_BATCH)}
        w = aggregation_weights(agg, n, sum(n.values()), sum(1 for v in n.values() if v),
                                norm_tokens=12)
        weights = torch.stack([torch.full((SEQ + 1,), w[r]) for r in range(GLOBAL_BATCH)])
        out[case] = TokenBatch(tokens=tokens, loss_mask=mask,
                               extras={**extras, "loss_weights": weights})
    return out


def _run(layout_names):
    import torch.distributed as dist

    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rl.losses import PolicyLossConfig
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import forward_backward, local_microbatches
    from earl_megatron.testing.tiny_models import tiny_model
    from earl_megatron.trainer.stages import _loss_fn
    from earl_megatron.weights.gather import gather_full

    cfg = tiny_model("qwen3")
    weights = reference_weights(cfg, seed=7)
    batches = _batch(cfg.vocab_size)
    out = {}
    with cpu_backend():
        for name in layout_names:
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
            for case, (kind, _) in CASES.items():
                mol = build_on_layout(cfg, lay, weights=weights)
                loss = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kind=kind)
                ratios: list = []
                mbs = local_microbatches(batches[case], lay, mol.coords, MBS)
                res = forward_backward(mol.model, mol.tcfg, mbs, lay, seq_len=SEQ,
                                       micro_batch_size=MBS, loss_fn=_loss_fn(loss, ratios))
                grads = gather_full(mol.model, cfg, lay, what="grad")
                if dist.get_rank() == 0:
                    out[(str(lay), case)] = (res.loss, grads)
            groups.destroy_groups()
    return out if dist.get_rank() == 0 else None


@functools.cache
def _reference():
    return {case: v for (_, case), v in run_distributed(_run, 1, ["tp1"])[0].items()}


def test_menu_losses_match_one_process_on_every_layout():
    ref = _reference()
    # the cases are not the same loss in disguise: each has its own loss or gradients (gspo
    # and gspo_token share the loss while no sequence is clipped, not the gradients)
    prints = [(round(loss, 6), round(sum(g.abs().sum().item() for g in grads.values()), 5))
              for loss, grads in ref.values()]
    assert len(set(prints)) == len(prints), prints
    results = run_distributed(_run, 2, LAYOUTS, timeout=600)[0]
    assert len(results) == len(LAYOUTS) * len(CASES)
    for (lay, case), (loss, grads) in results.items():
        ref_loss, ref_grads = ref[case]
        assert abs(loss - ref_loss) < TOL, (case, lay, loss, ref_loss)
        assert grads.keys() == ref_grads.keys(), (lay, set(grads) ^ set(ref_grads))
        for name, g in grads.items():
            diff = (g - ref_grads[name]).abs().max().item()
            assert diff < TOL, (case, lay, name, diff)
        assert sum(g.abs().sum().item() for g in grads.values()) > 1e-4, (case, lay)
