"""LiveView (plain lines off a terminal, rich Live on one) and the report PNG."""

import io
import re

import pytest
from rich.console import Console

from earl_megatron.trainer.live import LiveView, row_cells
from earl_megatron.trainer.report import eval_x, write_report

ANSI = re.compile(r"\x1b[\[\]()]")


def record(it, train="TP2xDP2", logprob=None, memory=True):
    rec = {"iteration": it, "layouts": {"rollout": "DP4", "train": train},
           "reward": -0.5 + 0.25 * it, "win_rate": 0.1 * it, "illegal_rate": 0.05,
           "unparsable_rate": 0.3, "mean_context": 110.4 + it, "max_context": 300 + it,
           "loss": 0.0123, "dispatch_bytes": 2**20 * (it + 1), "grad_norm": 1.25 + it,
           "entropy": 0.75, "clip_fraction": 0.125, "ratio_mean": 1.0005,
           "seconds": {"plan+switch": 0.2, "rollout": 12.3, "switch": 0.4, "train": 4.5,
                       "total": 17.4}}
    if logprob:
        rec["layouts"]["logprob"] = logprob
        rec["seconds"]["logprob"] = 1.5
    if memory:
        rec["predicted_memory_gb"] = {"rollout": 5.1, "train": 3.25}
    return rec


def test_plain_lines_off_a_terminal():
    buf = io.StringIO()
    with LiveView(total=3, start=0, console=Console(file=buf)) as view:
        view.message("resumed from ckpt [bold]x[/bold]")
        for it in range(3):
            view.update(record(it))
    out = buf.getvalue()
    assert not ANSI.search(out)
    lines = out.splitlines()
    assert lines[0] == "resumed from ckpt [bold]x[/bold]"   # free text, not markup
    assert lines[1].split()[:3] == ["iter", "rollout", "train"]
    assert len(lines) == 2 + 3                            # one header, one line per update
    assert len({len(l) for l in lines[1:]}) == 1          # fixed width
    first = lines[2].split()
    assert first[:9] == ["0", "DP4", "12.3s", "5.1G", "TP2xDP2", "4.5s", "3.2G", "110/300",
                         "-0.500"]
    # the update's columns, not the ~0 loss: grad norm, entropy, KL (none here), clip, ratio
    assert first[-7:-1] == ["1.250", "0.750", "-", "0.125", "1.0005", "17.4"]
    assert "+0.0123" not in lines[2]
    assert lines[1].split()[-7:] == ["gnorm", "ent", "kl", "clip", "ratio", "s/it", "eta"]


def test_plain_header_repeats_when_a_stage_appears():
    buf = io.StringIO()
    with LiveView(total=2, console=Console(file=buf)) as view:
        view.update(record(0))
        view.update(record(1, logprob="TP2xCP2"))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4
    assert lines[2].split()[:4] == ["iter", "rollout", "logprob", "train"]
    assert "TP2xCP2" in lines[3] and "1.5s" in lines[3]


def test_missing_keys_and_memory_render_blank():
    cells = row_cells({"iteration": 4, "layouts": {"rollout": "DP4"}}, ["rollout", "train"])
    assert cells[0].strip() == "4"
    assert cells[1].split() == ["DP4"] and cells[2].split() == ["-"]
    assert len(cells[1]) == len(row_cells(record(0), ["rollout"])[1])


def test_disabled_is_silent():
    buf = io.StringIO()
    with LiveView(total=3, console=Console(file=buf), enabled=False) as view:
        view.message("x")
        view.update(record(0))
    assert buf.getvalue() == ""


def test_rich_live_renders_on_a_terminal():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200)
    with LiveView(total=5, start=1, console=console) as view:
        view.message("evaluation: {}")
        view.update(record(1))
        view.update(record(2, train="TP4", logprob="TP2xCP2"))
        assert view.eta() is not None
    out = buf.getvalue()
    assert ANSI.search(out)                      # a live display, not plain lines
    text = ANSI.sub("", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out))
    assert "iteration 3/5" in text and "evaluation: {}" in text
    assert "TP2xCP2" in text and "TP4" in text and "111/301" in text


def test_eval_positions():
    hist = [record(i) for i in range(3)]
    assert [eval_x(w, hist) for w in ("start", "iter2", "end", "odd")] == [-1, 1, 2, None]


@pytest.mark.parametrize("history", [
    [record(0), record(1, train="TP4", logprob="TP2xCP2"), record(2, train="DP4", memory=False)],
    [record(0)],
    [{"iteration": 0, "layouts": {"rollout": "DP4", "train": "DP4"}, "reward": 0.1,
      "win_rate": 0.0, "seconds": {"total": 1.0}}],     # an older history: keys missing
    [],
])
def test_write_report_png(tmp_path, history):
    evals = {"start": {"random/greedy": {"win_rate": 0.0}, "random/sampled": {"win_rate": 0.1}},
             "iter2": {"random/greedy": {"win_rate": 0.4}},
             "end": {"random/greedy": {"win_rate": 0.6}, "random/sampled": {"win_rate": 0.5}}}
    path = write_report(tmp_path, history, evals)
    assert path == tmp_path / "report.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_write_report_tool_run_with_warm_start(tmp_path):
    """A tool-use history (accuracy, tool calls) and a warm start's losses: a wider PNG."""
    history = [dict(record(i), accuracy=0.5 + 0.1 * i, tool_calls=0.5 + 0.2 * i,
                    tool_error_rate=0.0, unparsable_rate=0.02) for i in range(3)]
    evals = {"start": {"calculator/greedy": {"accuracy": 0.5}},
             "end": {"calculator/greedy": {"accuracy": 0.9}}}
    sft = [{"step": s, "loss": 4.0 / (1 + s)} for s in range(0, 100, 10)]
    import matplotlib.image as mpimg

    plain = mpimg.imread(write_report(tmp_path, history, evals))
    wide = mpimg.imread(write_report(tmp_path, history, evals, sft=sft))
    assert wide.shape[1] > plain.shape[1] * 1.2 and wide.shape[0] == plain.shape[0]


def test_progress_plain_lines_at_each_quarter_and_detail():
    """Off a terminal a long step prints when it starts, when its detail changes and at each
    quarter of its total, never once per call; the next iteration's record ends it."""
    buf = io.StringIO()
    with LiveView(total=2, console=Console(file=buf)) as view:
        for done in range(0, 9):
            view.progress("warm start", done, 8, "steps")
        view.progress("evaluation start", 0, 0, "episodes", "random/greedy, play 1/2")
        for done in range(0, 5):
            view.progress("evaluation start", done, 8, "episodes", "random/greedy, play 1/2")
        for done in range(4, 9):
            view.progress("evaluation start", done, 8, "episodes", "random/sampled, play 2/2")
        view.update(record(0))
    lines = buf.getvalue().splitlines()
    assert not ANSI.search(buf.getvalue())
    counts = [l.split(": ", 1)[1].split(",")[0] for l in lines[:-2]]
    assert counts == ["0/8 steps (0%)", "2/8 steps (25%)", "4/8 steps (50%)", "6/8 steps (75%)",
                      "8/8 steps (100%)",
                      "0 episodes", "2/8 episodes (25%)", "4/8 episodes (50%)",
                      "4/8 episodes (50%)", "6/8 episodes (75%)", "8/8 episodes (100%)"]
    assert lines[0].startswith("warm start: 0/8 steps") and lines[0].endswith("eta --:--")
    assert lines[4].startswith("warm start: 8/8 steps") and lines[4].endswith("eta 00:00")
    assert lines[5].startswith("evaluation start (random/greedy, play 1/2): 0 episodes")
    assert lines[8].startswith("evaluation start (random/sampled, play 2/2): 4/8 episodes")
    assert lines[-2].split()[:3] == ["iter", "rollout", "train"]   # the iterations go on


def test_progress_on_a_terminal_is_a_bar_until_the_next_record():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200)
    with LiveView(total=5, console=console) as view:
        view.progress("warm start", 0, 40, "steps")
        view.progress("warm start", 30, 40, "steps")
        assert view.progress_eta() is not None
        view._live.refresh()
        view.update(record(0))
        assert view.progress_eta() is None
    text = ANSI.sub("", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()))
    assert "warm start 30/40 steps" in text
    last = text[text.rindex("iteration 1/5"):]
    assert "warm start" not in last             # gone once iteration 0 is recorded


def test_progress_disabled_is_silent():
    buf = io.StringIO()
    with LiveView(total=3, console=Console(file=buf), enabled=False) as view:
        view.progress("warm start", 1, 3, "steps")
    assert buf.getvalue() == ""
