"""SGLangRollout across a rollout layout change on real CPU servers (opt-in: EARL_SGLANG_VENV).

2 ranks, the same policy weights: play in DP2 (two tp1 servers), then in TP2 (one tp2 server,
SGLang's all-reduce over gloo): tp 1 -> 2 and dp 2 -> 1, rank 1's server stopped for good. The
play in TP2 restarts the servers in the new layout and pushes the weights before its first
request. Checked on both layouts: every rank returns its replica's
block (DP2: one block per rank; TP2: both ranks the whole batch), the episodes' SGLang logprobs
equal the trainer's recomputed ones within 1e-4 (fp32), the endpoints changed (2 servers -> 1),
the old servers' process groups are gone, and the weight plan's bytes: the leaders receive
exactly what they lack of the model (DP2: nothing; TP2: the tp1 half), rank 1 of TP2 nothing.
Each start is measured once for the planner's profile
table, (tp, seconds) with the same seconds on both ranks. (The way back, TP2 -> DP2, is the
moves test's colocated -> split restart: tests/sglang/test_sglang_moves.py; it ran here too
until two more server starts cost CI ~2 minutes.)
"""

from __future__ import annotations

import pytest

from earl_megatron.testing.multiproc import run_distributed

pytestmark = pytest.mark.timeout(2400)  # three server starts take minutes on 2 busy cores


def _play_in_two_layouts(python: str, out: str):
    import re
    from pathlib import Path

    import torch

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.tokenizer import GAME_ALPHABET, char_tokenizer
    from earl_megatron.runtime.build import OptimizerSpec
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.testing.multiproc import process_group_gone
    from earl_megatron.trainer.model_pair import build_model_pair
    from earl_megatron.trainer.old_logprobs import rescore
    from earl_megatron.trainer.record import gather_by_sample
    from earl_megatron.trainer.rollout import EpisodeSpec
    from earl_megatron.trainer.rollout_engines import make_rollout
    from earl_megatron.trainer.stages import BatchShape

    torch.set_num_threads(1)
    tok = char_tokenizer(GAME_ALPHABET)
    model = ModelConfig.tiny(vocab_size=32)
    spec = EpisodeSpec(env="connect_four", env_kwargs={"system_prompt": ""}, max_turns=3,
                       max_context_tokens=512, max_action_tokens=4, top_p=1.0)
    seeds = [11, 12, 13, 14]
    found = []
    with cpu_backend():
        models = build_model_pair(model, ParallelLayout(dp=2), None,
                                  optimizer=OptimizerSpec(lr=1e-3), seed=0)
        rollout = make_rollout("sglang", spec, tok, model=model, python=python, device="cpu",
                               out_dir=out)
        try:
            for lay in (ParallelLayout(dp=2), ParallelLayout(tp=2)):
                policy = models.policy_in(lay)
                ids, eps = rollout.play(policy, seeds, temperature=1.0, sample_seed=5)
                tokens = gather_by_sample(ids, [len(e.token_ids) for e in eps])
                _, diff, _ = rescore(policy, ids, eps, tokens, tok.pad_token_id, BatchShape(2),
                                  temperature=1.0, replace=False)
                m = rollout.metrics()
                found.append((str(lay), ids, len(eps), diff, list(rollout.endpoints),
                              m["rollout_weight_version"],
                              (m["weight_sync_bytes_in_max"], m["weight_sync_bytes_in_leader"])))
            # the servers of the first layout are stopped: every process group this rank
            # started (its logs name each start's pid) but the current servers' is gone. Not
            # their ports: a freed port is anyone's, e.g. the next servers' internal sockets
            rank = torch.distributed.get_rank()
            started = {int(p) for f in (Path(out) / "sglang").glob(f"logs-*-dp{rank}/server-*.log")
                       for p in re.findall(r"=== pid (\d+)", f.read_text())}
            engine = rollout.engine      # rank 1 leads no server in TP2
            old = started - {s.proc.pid for s in getattr(engine, "_servers", None) or []}
            # (>= 1: a server the supervisor restarted under load adds its pid)
            freed = len(old) >= 1 and all(map(process_group_gone, old))
            starts = rollout.take_starts()
        finally:
            rollout.close()
    return found, (freed, sorted(started), sorted(old)), starts


def test_layout_change_restarts_servers_and_carries_weights(sglang_python, run_dir):
    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.weight_plan import minimum_recv_bytes

    results = run_distributed(_play_in_two_layouts, 2, sglang_python, str(run_dir),
                              timeout=2100, collective_timeout_s=900)
    # the measured starts the planner prices restarts with: (tp, seconds), equal on every rank
    assert results[0][2] == results[1][2] and [tp for tp, _ in results[0][2]] == [1, 2]
    assert all(s > 0 for _, s in results[0][2])
    for rank, (found, freed, _) in enumerate(results):
        print(rank, found)
        (lay0, ids0, n0, diff0, ends0, v0, b0), (lay1, ids1, n1, diff1, ends1, v1, b1) = found
        assert lay0 == "DP2" and ids0 == ([0, 1] if rank == 0 else [2, 3]) and n0 == 2
        assert lay1 == "TP2" and ids1 == [0, 1, 2, 3] and n1 == 4
        assert all(d["rollout_logprob_diff_max"] < 1e-4 for d in (diff0, diff1))
        assert len(ends0) == 2 and len(ends1) == 1 and "tp2" in ends1[0]
        assert (v0, v1) == ("it1", "it2")  # a push into each layout's fresh servers
        assert freed[0], (rank, freed)
        # the weight plan: under DP2 both leaders hold the whole model and receive nothing;
        # under TP2 the one leader (rank 0) receives exactly the tp1 half, rank 1 nothing
        half = minimum_recv_bytes(ModelConfig.tiny(vocab_size=32), ParallelLayout(tp=2), 0)
        assert b0 == (0, 0) and b1 == (0, half) and half > 0, (b0, b1)
