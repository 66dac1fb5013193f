"""A model built without Megatron's random init carries exactly the parameter attributes of one
built with it, and trains identically once the same weights are loaded.

Megatron-Core 0.16 sets ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` only
inside its init functions; ``build_on_layout(init=False)`` (the switcher's path, and the default
when weights are given) sets them itself (models/provider.py::set_tensor_parallel_attributes).
One 4-rank launch; for llama (untied, SwiGLU stride 2), qwen2 (tied embeddings, qkv bias) and
qwen3 (q/k norms replicated over tp, head_dim 12 != hidden / heads) on
dp4, tp2-dp2, tp4, pp2-dp2, tp2-pp2 (tied with pp > 1: the last pp_stage's output_layer copy):

- every parameter's attribute names and (non-tensor) values after DDP + optimizer (a superset of
  the bare GPTModel's) are identical between ``init=True`` and ``init=False``;
- with the same weights loaded, one Adam step with grad clipping gives the same grad norm and
  loss (clipping is where a wrong ``tensor_model_parallel`` shows: TP shards counted once only).
"""

from earl_megatron.testing.tiny_models import tiny_model
from earl_megatron.testing.multiproc import run_distributed

WORLD = 4
LAYOUTS = ["dp4", "tp2-dp2", "tp4", "pp2-dp2", "tp2-pp2"]
FAMILIES = ["llama", "qwen2", "qwen3"]
SEQ, GLOBAL_BATCH, MBS = 8, 4, 1


def _attrs(module) -> dict:
    """{param name: {attribute: value}}; tensor-valued attributes (main_grad) by name only."""
    import torch

    return {n: {k: ("<tensor>" if isinstance(v, torch.Tensor) else v)
                for k, v in sorted(vars(p).items())}
            for n, p in module.named_parameters()}


def _job():
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import local_microbatches, random_batch, train_step
    from earl_megatron.models.sharding import reference_weights

    out = {}
    spec = OptimizerSpec(lr=1e-3, clip_grad=1e-3)  # a small clip: clipping always acts
    with cpu_backend():
        for family in FAMILIES:
            cfg = tiny_model(family)
            ref = reference_weights(cfg, seed=3)
            batch = random_batch(GLOBAL_BATCH, SEQ, cfg.vocab_size, seed=5)
            for name in LAYOUTS:
                lay = ParallelLayout.parse(name, WORLD, cfg)
                row = {}
                for init in (True, False):
                    mol = build_on_layout(cfg, lay, weights=ref, optimizer=spec, init=init)
                    row[("ddp", init)] = _attrs(mol.module())
                    mbs = local_microbatches(batch, mol.layout, mol.coords, MBS)
                    res = train_step(mol, mbs, seq_len=SEQ, micro_batch_size=MBS)
                    row[("step", init)] = (res.loss, res.grad_norm)
                    row[("tcfg_init", init)] = mol.tcfg.perform_initialization
                out[(family, name, dist.get_rank())] = row
    return out


def test_attributes_and_step_equal_with_and_without_init():
    results = run_distributed(_job, WORLD, timeout=240, collective_timeout_s=60)
    checked = 0
    for per_rank in results:
        for (family, name, rank), row in per_rank.items():
            where = (family, name, rank)
            for kind in ("ddp",):
                a, b = row[(kind, True)], row[(kind, False)]
                assert a.keys() == b.keys(), where
                for p in a:
                    assert a[p] == b[p], (where, kind, p, a[p], b[p])
                    checked += 1
            # every TP-split weight is marked (norms are the only replicated parameters)
            for p, at in row[("ddp", False)].items():
                assert at.get("tensor_model_parallel", False) == ("norm" not in p), (where, p, at)
                if "linear_fc1.weight" in p:
                    assert at["partition_stride"] == 2, (where, p, at)
            (loss_a, norm_a), (loss_b, norm_b) = row[("step", True)], row[("step", False)]
            assert loss_a == loss_b and norm_a == norm_b, (where, norm_a, norm_b)
            assert row[("tcfg_init", True)] and row[("tcfg_init", False)]
    assert checked > 0
