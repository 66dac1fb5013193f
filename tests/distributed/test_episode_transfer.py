"""runtime/episode_transfer.py on 4 gloo ranks: split placement's rollout pool hands its finished
episodes to the train pool, point to point, each to the ranks of the train replica whose block
it is; every rank calls it.

Pools: train = ranks 0-1, rollout = ranks 2-3, as DP2 <- TP2 (one rollout replica holds all 8
episodes) and TP2 <- DP2 (each rollout replica holds half). Groups of 2 (GRPO). Checked: train
replica d's ranks end with exactly block d (``train_blocks``), every episode equal to the one the
rollout pool held, field by field (logprobs bit-exact), whether the sizes are exchanged in the
call or given (as the meeting gathers them); rollout ranks end with nothing. Refused: a train
rank that passes episodes, sizes for another world, a train layout with cp > 1, an episode
without per-token versions. One episode packs and unpacks exactly; a truncated one is refused.
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
    from earl_megatron.runtime.episode_transfer import block_sizes, pack_block, train_blocks, \
        transfer_episodes

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
            packed = pack_block(ids, [_episode(s) for s in ids])
            sizes = [None] * 4     # as the meeting gathers them with its agreement
            dist.all_gather_object(sizes, block_sizes(packed))
            blocks = train_blocks(range(8), train.dp, 2)
            want = blocks[train.coords(me).dp] if me < 2 else []
            for given in (None, sizes):   # exchanged here, or given
                got_ids, got = transfer_episodes(train, rollout, packed, group_size=2,
                                                 sizes=given)
                out["pairs"].append((got_ids == want, got == [_episode(s) for s in want],
                                     got_ids))
        try:
            transfer_episodes(train, rollout, pack_block([99], [_episode(99)]) if me == 0 else {})
            out["train_sender"] = None
        except ValueError as e:
            out["train_sender"] = str(e)
        try:
            transfer_episodes(train, rollout, {}, sizes=[[]] * 3)
            out["short_sizes"] = None
        except ValueError as e:
            out["short_sizes"] = str(e)
        try:
            transfer_episodes(ParallelLayout.parse("cp2", 2), rollout, {})
            out["train_cp"] = None
        except ValueError as e:
            out["train_cp"] = str(e)
        bad = dataclasses.replace(_episode(1), versions=())
        try:
            pack_block([1], [bad])
            out["no_versions"] = None
        except ValueError as e:
            out["no_versions"] = str(e)
        groups.destroy_groups()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, 4, timeout=300)


def test_each_train_replica_gets_its_block_once_and_equal(results):
    for k in range(2 * len(PAIRS)):    # each pair with its sizes exchanged, then given
        for rank, res in enumerate(results):
            ids_ok, eps_ok, ids = res["pairs"][k]
            assert ids_ok and eps_ok, (PAIRS[k // 2], rank, ids)
            if rank >= 2:
                assert ids == []


def test_wrong_inputs_are_refused(results):
    for res in results:
        assert "train-pool ranks hold no episodes" in res["train_sender"]
        assert "episode 1:" in res["no_versions"]
        assert "per-token versions" in res["no_versions"]
        assert "sizes for 3 ranks in a world of 4" in res["short_sizes"]
        assert "cp=1 (a packed episode arrives whole)" in res["train_cp"]


def test_an_episode_packs_and_unpacks_exactly():
    import struct

    from earl_megatron.runtime.episode_transfer import pack_episode, unpack_episode

    for s in range(4):
        e = _episode(s)
        b = pack_episode(e)
        n, h = struct.unpack_from("<qq", b)     # the prefix: tokens, header bytes
        assert n == len(e.token_ids) and len(b) == 16 + 25 * n + h
        assert unpack_episode(b) == e
        assert unpack_episode(bytearray(b)).logprobs == e.logprobs   # bit-exact doubles
        with pytest.raises(ValueError, match="does not hold"):
            unpack_episode(b[:-1])
