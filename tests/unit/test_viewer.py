"""earl view's reading of a run directory (viewer/rundir.py, viewer/conversation.py) and its
HTTP routing (viewer/server.answer), in one process; the page in a browser: tests/browser/."""

import json

import pytest

from earl_megatron.testing.viewer_runs import write_run
from earl_megatron.viewer.conversation import conversation
from earl_megatron.viewer.rundir import NotARun, RunDir, check_run_dir, histogram, layout_view
from earl_megatron.viewer.server import STATIC, answer
from earl_megatron.viewer.server import main as view_main


def test_a_folder_that_is_not_a_run_is_refused_naming_the_fix(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(NotARun, match="is not a run directory.*run.output_dir"):
        check_run_dir(tmp_path)
    with pytest.raises(NotARun, match="no such directory"):
        check_run_dir(tmp_path / "missing")
    assert view_main([str(tmp_path), "--port", "0"]) == 2
    assert "earl view: " in capsys.readouterr().err


def test_metrics_are_read_as_written_a_cut_line_skipped(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"iteration": 0, "reward": 1.0}) + "\n" + '{"iteration": 1, "rew')
    run = RunDir(tmp_path)   # a live run: no samples, no evaluations, no configuration
    got = run.run()
    assert [r["iteration"] for r in got["records"]] == [0] and got["evals"] == {}
    assert not got["has_samples"] and run.page()["all"] == 0 and run.layouts()["rows"] == []
    f.write_text(f.read_text() + 'ard": 2.0}\n' + json.dumps({"iteration": 2}) + "\n")
    again = run.run(since=1)
    assert again["total"] == 3 and again["since"] == 1
    assert [r["iteration"] for r in again["records"]] == [1, 2]
    assert again["records"][0]["reward"] == 2.0


def test_samples_of_both_file_layouts_filtered_searched_and_paged(tmp_path):
    write_run(tmp_path / "one", 3, 4)
    write_run(tmp_path / "all", 3, 6, replicas=3)
    one, every = RunDir(tmp_path / "one"), RunDir(tmp_path / "all")
    assert one.page()["all"] == 12 and every.page()["all"] == 18
    rows = every.page(limit=200)["rows"]
    assert [r["replica"] for r in rows[:6]] == [0, 0, 1, 1, 2, 2]
    assert rows[2]["key"] == "0.1.2" and one.page()["rows"][0]["key"] == "0.-.0"
    assert every.page(iteration=2)["total"] == 6
    assert every.page(iteration=2, offset=4, limit=5)["rows"][0]["key"] == "2.2.4"
    finish = every.page(finish="max_turns")
    assert finish["total"] == sum(r["finish_reason"] == "max_turns" for r in rows) > 0
    right = every.page(reward_min=0.5)
    assert right["total"] == sum(r["reward"] >= 0.5 for r in rows)
    some = every.sample(rows[5]["key"])
    calc = some["actions"][0]
    assert calc.startswith("<calc>")
    assert every.page(text=calc.upper())["total"] >= 1   # case-insensitive, over the text
    assert every.page(text="no such text anywhere")["total"] == 0
    facets = every.page()["facets"]
    assert facets["iterations"] == [0, 1, 2] and facets["envs"] == ["calculator"]
    assert every.sample("9.9.9") is None


def test_a_sample_is_a_conversation_with_trained_spans_and_tool_calls(tmp_path):
    write_run(tmp_path, 1, 1)
    run = RunDir(tmp_path)
    s = run.sample(run.page()["rows"][0]["key"])
    turns = s["conversation"]
    assert [t["kind"] for t in turns] == ["user", "assistant", "tool", "assistant"]
    # every character of the text is in exactly one span, in order
    assert "".join(sp["text"] for t in turns for sp in t["spans"]) == s["text"]
    trained = "".join(sp["text"] for t in turns for sp in t["spans"] if sp["trained"])
    assert trained == "".join(seg["text"] for seg in s["segments"] if seg["trained"])
    call = [sp for sp in turns[1]["spans"] if sp["kind"] == "tool_call"]
    assert len(call) == 1 and call[0]["trained"] and call[0]["text"] == s["actions"][0]
    assert not turns[2]["trained"] and "<result>" in "".join(sp["text"] for sp in turns[2]["spans"])
    assert turns[1]["versions"] == turns[3]["versions"] == [0] and turns[0]["versions"] == []


def test_chatml_turns_and_later_user_turns_are_observations():
    text = ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nboard 1<|im_end|>\n"
            "<|im_start|>assistant\n")
    sample = {"segments": [
        {"trained": False, "text": text},
        {"trained": True, "text": "<tool_call>\n{}\n</tool_call><|im_end|>", "version": 4},
        {"trained": False, "text": "\n<|im_start|>user\nboard 2<|im_end|>\n<|im_start|>tool\n7"
                                   "<|im_end|>\n<|im_start|>assistant\n"},
        {"trained": True, "text": "done<|im_end|>", "version": 5}]}
    turns = conversation(sample)
    assert [t["kind"] for t in turns] == ["system", "user", "assistant", "observation", "tool",
                                          "assistant"]
    assert [t["versions"] for t in turns] == [[], [], [4], [], [], [5]]
    # the newline after <|im_end|> is the next segment's (untrained): it stays a text span
    assert [(sp["kind"], sp["trained"]) for sp in turns[2]["spans"]] == [
        ("template", False), ("tool_call", True), ("template", True), ("text", False)]
    assert conversation({"text": "plain"}) == [
        {"role": "prompt", "kind": "user", "versions": [], "trained": False,
         "spans": [{"kind": "text", "text": "plain", "trained": False}]}]


def test_layouts_view_has_switches_with_reasons_and_the_context_distribution():
    recs = [{"iteration": i, "layouts": {"rollout": "TP1", "train": lay},
             "seconds": {"train": 1.0 + i}, "predicted_memory_gb": {"train": 2.0},
             **({"layout_reasons": {"train": f"why {i}"}} if i else {})}
            for i, lay in enumerate(["DP2", "DP2", "TP2"])]
    v = layout_view(recs, [{"tokens": t} for t in (10, 12, 30)])
    assert v["stages"] == ["rollout", "train"]
    assert v["switches"] == [{"iteration": 2, "stage": "train", "from": "DP2", "to": "TP2",
                              "reason": "why 2"}]
    train = [r for r in v["rows"] if r["stage"] == "train"]
    assert [r["seconds"] for r in train] == [1.0, 2.0, 3.0]
    assert train[0]["predicted_memory_gb"] == 2.0 and train[0]["measured_memory_gb"] is None
    assert sum(b["count"] for b in v["histogram"]) == 3
    assert histogram([]) == [] and histogram([5, 5]) == [{"lo": 5, "hi": 5, "count": 2}]


def test_routes_answer_json_static_files_only_and_bad_queries_by_name(tmp_path):
    write_run(tmp_path, 2, 2)
    (tmp_path / "metrics.jsonl").write_text(
        (tmp_path / "metrics.jsonl").read_text() + '{"iteration": 2, "loss": NaN}\n')
    run = RunDir(tmp_path)
    status, ctype, body = answer(run, "/api/run", "since=2")
    assert status == 200 and json.loads(body)["records"] == [{"iteration": 2, "loss": None}]
    for name in STATIC:
        status, ctype, body = answer(run, f"/static/{name}", "")
        assert status == 200 and body
    assert answer(run, "/", "")[2].startswith(b"<!doctype html>")
    assert answer(run, "/static/../rundir.py", "")[0] == 404
    assert answer(run, "/static/server.py", "")[0] == 404
    status, _, body = answer(run, "/api/samples", "limit=5000")
    assert status == 400 and b"limit" in body
    assert answer(run, "/api/samples", "reward_min=high")[0] == 400
    status, _, body = answer(run, "/api/samples", "limit=1&offset=1")
    assert json.loads(body)["rows"][0]["key"] == "0.-.1"
    assert answer(run, "/api/sample", "key=0.-.1")[0] == 200
    assert answer(run, "/api/sample", "key=7.-.7")[0] == 404
    assert answer(run, "/report.png", "")[0] == 404   # written at the end of a run
    layouts = json.loads(answer(run, "/api/layouts", "")[2])
    assert layouts["stages"] == ["rollout", "logprob", "train"]
