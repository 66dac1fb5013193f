"""LoRA on SGLang servers (issue #46 item 4): the base once, then only adapters cross.

A 2-rank run from ``run.init=ADAPTER`` (a PEFT adapter that ``peft`` made on a tiny Llama, B
not zero: it moves the logits by about 0.7, so a server that ignored it could not match), rollout
layout tp2 (one server, its two tp ranks), train layout tp2. The servers start with adapters
on; the first push brings the base (untagged) and the adapter as ``it1`` (SGLang's
/load_lora_adapter_from_tensors); every push after a TRAIN step moves the adapters alone,
loaded as the next version.

Checked:
- every iteration's rollout logprobs (SGLang's, sampled with the adapter) equal the trainer's
  (Megatron's, with the adapter) within 1e-4: the servers applied the current adapter;
- each push recorded after a TRAIN step moved exactly the adapters' bytes (the weight plan's
  adapter rows), never the base;
- the server log shows one adapter loaded per version (it1, it2, it3) and no tagged full push;
- nothing of the base's size was written: the adapters go by value in the load request.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from earl_megatron.testing.multiproc import run_distributed

pytestmark = pytest.mark.timeout(1800)

MODULES = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def _records(out, *keys) -> list[dict]:
    """The run's iteration records (metrics.jsonl), ``keys`` of each printed."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
             if x.strip()]
    lines = [x for x in lines if "iteration" in x]
    print(json.dumps([{k: x.get(k) for k in ("iteration",) + keys} for x in lines], indent=1))
    return lines


def _bytes(model, adapters: bool) -> int:
    """fp32 bytes of ``model``'s adapter rows (or of every other row)."""
    from earl_megatron.plan.tensor_table import tensor_table
    return sum(r.numel * 4 for r in tensor_table(model).full_rows if r.adapter == adapters)


def test_lora_run_on_sglang_pushes_the_base_once_then_adapters(sglang_python, run_dir):
    from earl_megatron.testing.configs import tiny_connect_four
    from earl_megatron.testing.peft_check import peft_adapter
    from earl_megatron.testing.tiny_models import tiny_model
    from earl_megatron.train import init_config

    _, adapter = peft_adapter(run_dir, tiny_model("llama", vocab_size=32), MODULES)
    model = init_config(str(adapter))
    assert model.lora.rank == 8   # q and v: PEFT drew an A each, stacked (weights/peft_import)
    out = run_dir / "run"
    cfg = tiny_connect_four(
        str(out), model=dataclasses.asdict(model),
        layout={"mode": "static", "rollout": "tp2", "logprob": "tp2", "train": "tp2"},
        env={"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
             "eval_opponents": []},
        rollout={"engine": "sglang", "sglang_python": sglang_python, "sglang_device": "cpu",
                 "episodes_per_iteration": 4, "max_turns": 4},
        algorithm={"micro_batch_size": 2},
        cluster={"collective_timeout_s": 900, "server_start_timeout_s": 300,
                 "server_request_timeout_s": 60, "weight_sync_timeout_s": 45,
                 "server_max_restarts": 2},
        run={"init": str(adapter), "iterations": 2, "checkpoint_every": 0,
             "eval_episodes": 2, "live_view": False})
    run_distributed(_train, 2, cfg, timeout=1500,
                    collective_timeout_s=cfg.cluster.collective_timeout_s)
    lines = _records(out, "rollout_logprob_diff_max", "rollout_weight_version",
                     "rollout_push_bytes")
    assert [x["iteration"] for x in lines] == [0, 1]
    adapter_bytes, base_bytes = _bytes(model, True), _bytes(model, False)
    assert 0 < adapter_bytes < base_bytes / 4
    for x in lines:
        assert x["rollout_engine"] == "sglang" and x["layouts"]["rollout"] == "TP2"
        assert x["rollout_logprob_diff_max"] < 1e-4, x
        assert x["rollout_push_bytes"] == adapter_bytes, (x["rollout_push_bytes"], adapter_bytes)
    assert [x["rollout_weight_version"] for x in lines] == ["it2", "it3"]
    log = next((out / "sglang").glob("logs-*/server-0.log")).read_text()
    assert re.findall(r"=== weight version (it\d+): adapter loaded", log) == ["it1", "it2", "it3"]
    assert "tensors pushed" not in log     # the base went untagged, once
    files = [p for p in (out / "sglang").rglob("*") if p.is_file() and p.suffix != ".log"]
    assert sum(p.stat().st_size for p in files) < base_bytes / 10, files


def test_lora_on_a_split_rollout_pools_server_takes_adapters_from_the_handoff(sglang_python,
                                                                            run_dir):
    """Split placement, 3 ranks: the train pool (ranks 0-1, TP2) hands the rollout pool's
    server (rank 2, one TP1 server that holds no model) the whole model at the first handoff
    and the adapters alone at the next; the server loads each as the version's adapter.
    Iteration 0's episodes were sampled with the start's weights, which the train pool scores
    them with: SGLang's logprobs with the adapter equal Megatron's there."""
    import sys
    from pathlib import Path

    from earl_megatron.testing.peft_check import peft_adapter
    from earl_megatron.testing.tiny_models import tiny_model
    from earl_megatron.train import init_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from split_audit import check_exactly_once, read_audit, split_config, train_audited

    _, adapter = peft_adapter(run_dir, tiny_model("llama", vocab_size=32), MODULES)
    model = init_config(str(adapter))
    out, audit = run_dir / "split", run_dir / "audit"
    cfg = split_config(str(out), 2, 1, cluster={
        "collective_timeout_s": 900, "server_start_timeout_s": 300,
        "server_request_timeout_s": 60, "weight_sync_timeout_s": 45,
        "server_max_restarts": 2}, checkpoint_every=0, init=str(adapter))
    d = cfg.to_dict()
    d["model"] = dataclasses.asdict(model)
    d["layout"].update(train="tp2", logprob="tp2", rollout="dp1")
    d["rollout"].update(pool_ranks=1, engine="sglang", sglang_python=sglang_python,
                        sglang_device="cpu")
    cfg = type(cfg).from_dict(d)
    run_distributed(train_audited, 3, cfg, str(audit), timeout=1500,
                    collective_timeout_s=cfg.cluster.collective_timeout_s)
    check_exactly_once(read_audit(audit), 2)
    lines = _records(out, "rollout_logprob_diff_max", "rollout_weight_version", "split")
    assert [x["iteration"] for x in lines] == [0, 1]
    assert lines[0]["rollout_logprob_diff_max"] < 1e-4, lines[0]
    adapter_bytes = _bytes(model, True)
    # meeting 1 moved the adapters alone, to the server's leader
    assert lines[1]["split"]["handoff_bytes"] == adapter_bytes, (lines[1]["split"],
                                                                 adapter_bytes)
    # the records' push is the start's (stage 1 plays under it1): the whole model
    whole = adapter_bytes + _bytes(model, False)
    assert [x["rollout_push_bytes"] for x in lines] == [whole, whole]
    log = (out / "sglang" / "logs-TP1-dp0" / "server-0.log").read_text()
    assert re.findall(r"=== weight version (it\d+): adapter loaded", log) == ["it1", "it2"]
    assert "tensors pushed" not in log
