"""Every algorithm through the trainer (2 ranks, 2 iterations each, one launch): REINFORCE++,
GRPO and REINFORCE++ over 2 epochs per batch, each with the KL off and in the loss. Each run records one metrics line per
iteration with a finite loss, and the advantages it trained on have the estimator's defining
property on the GLOBAL batch (GRPO: every group's mean is 0; REINFORCE++: the batch mean
per policy token is 0) although every rank holds only its replica's samples."""

import json
import math

from earl_megatron.stages import ITERATION_TIMERS
from earl_megatron.testing.configs import tiny_connect_four
from earl_megatron.testing.multiproc import run_distributed

CASES = {"reinforce_pp": {"name": "reinforce_pp"}, "grpo": {"name": "grpo", "group_size": 2},
         "multi_epoch": {"name": "reinforce_pp", "epochs": 2}}
KL = [("off", {}), ("loss", {"kl_mode": "loss", "kl_coef": 0.1})]


def _cfg(out, algorithm):
    return tiny_connect_four(out, algorithm=algorithm)


def _all(root):
    from earl_megatron.train import run

    out = {}
    for case, algorithm in CASES.items():
        for kl, kl_extra in KL:
            out[f"{case}/{kl}"] = run(_cfg(f"{root}/{case}-{kl}", {**algorithm, **kl_extra}))
    return out


def test_every_algorithm_trains_end_to_end(tmp_path):
    results = run_distributed(_all, 2, str(tmp_path), timeout=600)
    for key in results[0]:
        assert [h["loss"] for h in results[0][key]] == [h["loss"] for h in results[1][key]], key
    for key, hist in results[0].items():
        case, kl = key.split("/")
        lines = (tmp_path / f"{case}-{kl}" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["iteration"] for x in lines] == [0, 1], key
        for h in hist:
            assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]), (key, h)
            if CASES[case]["name"] == "grpo":
                assert h["advantage_group_mean_max"] < 1e-6, (key, h)
                assert "advantage_mean" not in h
            else:
                assert abs(h["advantage_mean"]) < 1e-6, (key, h)
            assert ("kl" in h) == (kl == "loss"), key
            # the runner times exactly the phases the report and the live view know
            assert set(h["seconds"]) <= {*ITERATION_TIMERS, "total"}, h["seconds"]
            assert ("logprob" in h["seconds"]) == (kl == "loss"), key
        if kl == "loss":
            # iteration 0 samples from the reference itself
            assert hist[0]["ref_log_ratio_max"] < 1e-4, key
