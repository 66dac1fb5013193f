"""The trainer's side of SGLang's weight-update group (rollout/sglang_weights.py
``trainer_weight_update_group``) on a rank that is not global rank 0, as a split's rollout
leader is: torch's lookups of this process's group rank answer 0 (the mapping said {i: i}, so
on global rank 2 a gloo error in a push became "Global rank 2 is not part of group", a
ValueError the engine's restart path did not take). The group here has this process alone
(the servers' ranks join it in tests/sglang); gloo, 3 ranks."""

import torch
import torch.distributed as dist

from earl_megatron.runtime.dist import free_port
from earl_megatron.testing.multiproc import run_distributed


def _on_rank_2():
    from earl_megatron.rollout.sglang_weights import trainer_weight_update_group

    if dist.get_rank() != 2:
        return None
    group = trainer_weight_update_group("127.0.0.1", free_port(), 1, backend="gloo",
                                        timeout_s=60)
    t = torch.arange(3.0)
    dist.broadcast(t, group=group, group_src=0)     # what push_weights does
    return (dist.get_rank(group), dist.get_group_rank(group, 2),
            dist.get_global_rank(group, 0), t.tolist())


def test_the_weight_group_knows_this_rank_as_its_rank_0():
    got = run_distributed(_on_rank_2, 3, timeout=120)
    assert got[:2] == [None, None]
    assert got[2] == (0, 0, 2, [0.0, 1.0, 2.0])
