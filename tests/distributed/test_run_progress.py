"""What a person watching a run off a terminal (a Slurm log) sees of the long steps between
iterations: the warm start's steps and each evaluation's episodes, through what the trainer
runs (earl_megatron.train.run on 2 ranks, run.live_view=false: rank 0's plain lines). The
counts are the run's own: 3 warm-start steps; 4 evaluation episodes per mode on dp2, so rank
0's replica plays 2 of each of the 2 modes (greedy, sampled): 4 episodes in all."""

import contextlib
import io
import re
from pathlib import Path

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed

TRACES = Path(__file__).resolve().parents[1] / "data" / "calculator_traces.jsonl"
LINE = re.compile(r"^(warm start|evaluation \w+)(?: \((.+)\))?: (\d+)(?:/(\d+))? (\w+)"
                  r"(?: \((\d+)%\))?, elapsed \d\d:\d\d, eta (?:\d\d:\d\d|--:--)$")


def _run_captured(cfg):
    from earl_megatron.train import run
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):   # rank 0's live view writes to sys.stdout
        run(cfg)
    return buf.getvalue()


def _cfg(out):
    return TrainConfig.from_dict({
        "model": {"vocab_size": 64, "num_attention_heads": 4, "num_query_groups": 2},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "dp2"},
        "env": {"name": "calculator", "kwargs": {"system_prompt": "", "num_operands": 2},
                "eval_opponents": []},
        "rollout": {"tokenizer": "tool", "episodes_per_iteration": 4, "max_turns": 3,
                    "max_action_tokens": 8},
        "algorithm": {"micro_batch_size": 2},
        "sft": {"steps": 3, "batch_size": 4, "data": str(TRACES), "log_every": 1},
        "run": {"iterations": 1, "output_dir": str(out), "eval_episodes": 4,
                "live_view": False},
    })


def test_warm_start_and_evaluations_report_their_progress(tmp_path):
    out = run_distributed(_run_captured, 2, _cfg(tmp_path / "run"), timeout=400)
    assert out[1] == ""                      # rank 1 shows nothing
    steps = [LINE.match(l) for l in out[0].splitlines()]
    steps = [m.groups() for m in steps if m]
    warm = [(int(m[2]), int(m[3])) for m in steps if m[0] == "warm start"]
    assert warm == [(0, 3), (1, 3), (2, 3), (3, 3)]   # a line per quarter crossed
    for when in ("start", "end"):
        ev = [m for m in steps if m[0] == f"evaluation {when}"]
        plays = [m[1] for m in ev]
        assert plays[0] == "calculator/greedy, play 1/2"
        assert plays[-1] == "calculator/sampled, play 2/2"
        assert plays == sorted(plays, key=lambda p: p.endswith("2/2"))  # greedy, then sampled
        done = [int(m[2]) for m in ev]
        assert done == sorted(done)                       # never back
        assert ev[-1][2:5] == ("4", "4", "episodes")     # 2 plays x rank 0's 2 episodes
        # the sampled play starts where the greedy one ended: 2 of 4
        first_sampled = next(m for m in ev if m[1].endswith("2/2"))
        assert first_sampled[2:4] == ("2", "4")
