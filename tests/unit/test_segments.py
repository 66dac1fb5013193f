"""A run in segments: eval.json merged across resumed jobs, the world a checkpoint was written on,
the message an elastic resume prints."""

from earl_megatron.trainer.segments import (merge_evals, read_evals, resume_message, saved_world,
                                            write_evals)


def test_merge_keeps_earlier_segments_and_renames_their_end():
    first = {"start": {"w": 0.0}, "end": {"w": 0.5}}          # a segment that ran to iteration 4
    second = {"iter8": {"w": 0.6}, "end": {"w": 0.7}}
    merged = merge_evals(first, 4, second)
    assert merged == {"start": {"w": 0.0}, "iter4": {"w": 0.5}, "iter8": {"w": 0.6},
                      "end": {"w": 0.7}}
    # a preempted segment had no "end"; a fresh run (start 0) replaces nothing
    assert merge_evals({"start": 1, "iter2": 2}, 3, {"end": 3}) == {"start": 1, "iter2": 2,
                                                                    "end": 3}
    assert merge_evals({}, 0, {"start": 1}) == {"start": 1}


def test_eval_file_round_trip_and_damaged_file(tmp_path):
    assert read_evals(tmp_path) == {}
    write_evals(tmp_path, {"start": {"random/greedy": {"win_rate": 0.25}}})
    assert read_evals(tmp_path) == {"start": {"random/greedy": {"win_rate": 0.25}}}
    (tmp_path / "eval.json").write_text('{"start": ')  # cut by a kill
    assert read_evals(tmp_path) == {}


def test_saved_world_and_elastic_message():
    assert saved_world({"layout": "TP2xDP2"}) == 4
    assert saved_world({"layout": "TP1"}) == 1
    assert saved_world({"layout": "TP2", "world_size": 4}) == 4
    assert resume_message({"layout": "DP4"}, 4, True) is None
    msg = resume_message({"layout": "DP4"}, 2, True)
    assert msg.startswith("checkpoint of 4 ranks resumed on 2") and "selector state reset" in msg
    assert "layout=static" in resume_message({"layout": "TP2"}, 4, False)
