"""The whole optimizer state of a live model, gathered (tests of the switcher: the state moved
by a switch must equal, bit for bit, the state before it)."""

from __future__ import annotations


class _Named:
    """Stands in for a module in gather_full: named tensors (here fp32 state shards)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def named_parameters(self):
        return iter(self.tensors.items())


def gathered_state(mol):
    """({kind: {name: full fp32 tensor}} of the masters (bf16 / fp16 weights only) and the
    moments (once stepped), whether every weight on this rank equals its master cast to the
    weight's dtype (True without masters)). Collective over the model's pool; the names are
    the tensor table's (a critic's head included)."""
    import torch
    import torch.distributed as dist

    from earl_megatron.runtime import groups
    from earl_megatron.runtime.optimizer_state import (MASTER, has_masters, optimizer_state,
                                                       state_kinds)
    from earl_megatron.weights.gather import gather_full

    flat, ranges, step = optimizer_state(mol)
    kinds = state_kinds(has_masters(mol), step is not None)
    distributed = mol.optimizer.config.use_distributed_optimizer
    params = dict(mol.module().named_parameters())
    state = {}
    for n, p in params.items():   # whole TP shards: each dp x cp rank fills its own range
        shape, a, b = ranges.get(n, (tuple(p.shape), 0, 0))
        state[n] = {}
        for k in kinds:
            whole = torch.zeros(p.numel(), dtype=torch.float32)
            if n in flat:
                whole[a:b] = flat[n][k]
            if distributed:
                dist.all_reduce(whole, group=groups.dp_group(with_context_parallel=True))
            state[n][k] = whole.view(shape)
    cast = MASTER not in kinds or all(
        torch.equal(params[n].detach(), s[MASTER].to(params[n].dtype)) for n, s in state.items())
    full = {k: gather_full(_Named({n: s[k] for n, s in state.items()}), mol.cfg, mol.layout)
            for k in kinds}
    return full, cast
