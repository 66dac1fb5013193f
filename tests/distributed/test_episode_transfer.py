"""runtime/episode_transfer.py on 4 gloo ranks: split placement's rollout pool hands its finished
episodes to the train pool, point to point, each to the ranks of the train replica whose block
it is; every rank calls it.

Pools: train = ranks 0-1, rollout = ranks 2-3, as DP2 <- TP2 (one rollout replica holds all 8
episodes) and TP2 <- DP2 (each rollout replica holds half). Groups of 2 (GRPO). Checked: train
replica d's ranks end with exactly block d (``train_blocks``), every episode equal to the one the
rollout pool held, field by field (logprobs bit-exact); rollout ranks end with nothing; a train
rank that passes episodes is refused; an episode without per-token versions is refused.
"""

import pytest

from earl_megatron.testing.multiproc import run_distributed

PAIRS = [("dp2", "tp2"), ("tp2", "dp2")]


def _episode(s: int):
    from earl_megatron.rollout.agent_loop import Episode

    n = 5 + 3 * (s % 4)
    mask = tuple(int(i >= 3) for i in range(n))
    return Episode(env="connect_four", seed=100 + s, token_ids=tuple(range(s, s + n)),
                   loss_mask=mask, logprobs=tuple(-(i + s) / 7.0 if m else 0.0
                                                  for i, m in enumerate(mask)),
                   reward=0.25 * s, turns=2, finish_reason="done", prompt_length=3,
                   actions=("a", f"b{s}"), observations=("o", "p", "q"), info={"k": s},
                   turn_rewards=(0.0, 0.25 * s), observation_roles=("user", "user", "user"),
                   versions=tuple(s % 2 if m else -1 for m in mask))


def _run():
    import dataclasses

    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.episode_transfer import train_blocks, transfer_episodes

    me = dist.get_rank()
    out = {"pairs": []}
    with cpu_backend():
        for a, b in PAIRS:
            train, rollout = ParallelLayout.parse(a, 2), ParallelLayout.parse(b, 2)
            groups.build_pool_groups((train, rollout))
            ids = []
            if me >= 2:     # a DP2 rollout pool: replica r holds ids 4r .. 4r+3
                ids = list(range(8)) if rollout.dp == 1 else list(range(4 * (me - 2),
                                                                        4 * (me - 2) + 4))
            got_ids, got = transfer_episodes(train, rollout, ids, [_episode(s) for s in ids],
                                             group_size=2)
            blocks = train_blocks(range(8), train.dp, 2)
            want = blocks[train.coords(me).dp] if me < 2 else []
            out["pairs"].append((got_ids == want, got == [_episode(s) for s in want],
                                 got_ids))
        try:
            transfer_episodes(train, rollout, [99] if me == 0 else [],
                              [_episode(99)] if me == 0 else [])
            out["train_sender"] = None
        except ValueError as e:
            out["train_sender"] = str(e)
        bad = dataclasses.replace(_episode(1), versions=())
        try:
            transfer_episodes(train, rollout, [1], [bad])
            out["no_versions"] = None
        except ValueError as e:
            out["no_versions"] = str(e)
        groups.destroy_groups()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, 4, timeout=300)


def test_each_train_replica_gets_its_block_once_and_equal(results):
    for k, pair in enumerate(PAIRS):
        for rank, res in enumerate(results):
            ids_ok, eps_ok, ids = res["pairs"][k]
            assert ids_ok and eps_ok, (pair, rank, ids)
            if rank >= 2:
                assert ids == []


def test_wrong_inputs_are_refused(results):
    for res in results:
        assert "train-pool ranks hold no episodes" in res["train_sender"]
        assert "per-token versions" in res["no_versions"]
