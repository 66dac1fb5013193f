"""The trainer's supervised warm start on 2 ranks, then RL on the calculator: sft.jsonl and the
tool metrics are recorded, the loss falls, and a warm start resumed from its checkpoint gives
the same losses and the same first RL iteration as a run that never stopped. The kill after
step 1 of 4 is staged on disk: a run of 2 warm-start steps, its RL checkpoint removed (what a
run killed right after the warm start's step-1 checkpoint leaves), then the same directory
with 4 steps."""

import json
from pathlib import Path

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed

TRACES = Path(__file__).resolve().parents[1] / "data" / "calculator_traces.jsonl"


def _cfg(out, steps, iterations, layout="static"):
    lay = ({"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp2"}
           if layout == "static" else {"mode": "auto"})
    return TrainConfig.from_dict({
        "model": {"vocab_size": 64, "num_attention_heads": 4, "num_query_groups": 2},
        "layout": lay,
        "env": {"name": "calculator", "kwargs": {"system_prompt": "", "num_operands": 2},
                "eval_opponents": []},
        "rollout": {"tokenizer": "tool", "episodes_per_iteration": 8, "max_turns": 3,
                    "max_action_tokens": 16},
        "algorithm": {"micro_batch_size": 4},
        "sft": {"steps": steps, "batch_size": 8, "data": str(TRACES), "lr": 1e-2,
                "log_every": 1},
        "run": {"iterations": iterations, "output_dir": str(out), "checkpoint_every": 2,
                "eval_episodes": 4, "live_view": False},
    })


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def _sft_lines(out):
    return [json.loads(x) for x in (Path(out) / "sft.jsonl").read_text().splitlines()]


def _strip(h):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in h]


def test_warm_start_then_rl_and_resume(tmp_path):
    full = run_distributed(_train, 2, _cfg(tmp_path / "full", 4, 1), timeout=400)[0]
    sft = _sft_lines(tmp_path / "full")
    assert [r["step"] for r in sft] == [0, 1, 2, 3] and {r["layout"] for r in sft} == {"TP2"}
    assert sft[-1]["loss"] < sft[0]["loss"]
    rec = full[0]
    for key in ("accuracy", "tool_calls", "tool_error_rate", "unparsable_turn_rate"):
        assert 0.0 <= rec[key] <= 3.0, (key, rec)
    evals = json.loads((tmp_path / "full" / "eval.json").read_text())
    assert set(evals["start"]) == {"calculator/greedy", "calculator/sampled"}
    assert "accuracy" in evals["end"]["calculator/sampled"]
    assert (tmp_path / "full" / "report.png").exists()
    assert (tmp_path / "full" / "checkpoints" / "sft" / "iter_000003").is_dir()

    part = tmp_path / "part"
    run_distributed(_train, 2, _cfg(part, 2, 1), timeout=400)
    assert [r["step"] for r in _sft_lines(part)] == [0, 1]
    import shutil
    for p in (part / "checkpoints").iterdir():
        if p.name != "sft":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    resumed = run_distributed(_train, 2, _cfg(part, 4, 1), timeout=400)[0]
    again = _sft_lines(part)
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    assert [r["loss"] for r in again] == [r["loss"] for r in sft]
    assert _strip(resumed) == _strip(full)


def test_warm_start_with_selector_layouts(tmp_path):
    """layout=auto: the selector plans the TRAIN stage of every warm-start step."""
    hist = run_distributed(_train, 2, _cfg(tmp_path / "auto", 2, 1, layout="auto"),
                           timeout=400)[0]
    assert len(hist) == 1 and "accuracy" in hist[0]
    assert all(r["layout"] for r in _sft_lines(tmp_path / "auto"))
