"""Checkpoint files without a process group: which checkpoint a resume picks (the newest complete
one, skipping damaged ones with a message), retention (exact folders left), fsync before every
rename that publishes, a re-save failed at each of its steps in turn (a complete checkpoint at
every moment), and a new run refused in a folder that holds one.

The folders here are what save_checkpoint leaves (loop.json, dist_checkpointing's metadata
files, a shard); the real Megatron save and load of the same paths is
tests/distributed/test_checkpoint_safety.py."""

import json
import os
import shutil

import pytest

from earl_megatron.config.train import ConfigError, RunConfig
from earl_megatron.runtime import checkpoint_files as ck
from earl_megatron.runtime.checkpoint_files import (CheckpointError, damage, find_checkpoint,
                                                    latest_checkpoint, retention)
from earl_megatron.trainer.segments import earlier_run


def _fill(d, iteration, payload="w"):
    """A folder with what a save writes: loop.json, the two metadata files, one shard."""
    d.mkdir(parents=True)
    (d / "loop.json").write_text(json.dumps({"iteration": iteration, "payload": payload}))
    for name in ("metadata.json", ".metadata"):
        (d / name).write_text("{}")
    (d / "__0_0.distcp").write_text(payload)


def _published(root, iteration, payload="w"):
    _fill(root / f"iter_{iteration:06d}", iteration, payload)
    (root / "latest").write_text(f"iter_{iteration:06d}")


def _save(root, iteration, keep_last=None, payload="w"):
    """save_checkpoint's rank-0 part on a folder the shards were written to."""
    tmp = root / f"iter_{iteration:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # as save_checkpoint does: a killed save's leftover
    _fill(tmp, iteration, payload)
    ck._publish(tmp, ck.checkpoint_dir(root, iteration), keep_last, iteration)


def _names(root):
    return sorted(p.name for p in root.iterdir())


def test_retention_is_oldest_first_and_counts_complete_checkpoints():
    # (iteration, complete), oldest first
    assert retention([(1, True), (2, True), (3, True), (4, True)], 4, 2) == [0, 1]
    assert retention([(1, True), (2, True)], 2, 3) == []
    assert retention([(1, True), (2, True)], 2, None) == []
    # a damaged one between the kept ones stays (for inspection); older ones go
    assert retention([(1, True), (2, True), (3, False), (4, True)], 4, 2) == [0]
    # checkpoints newer than the one just saved (a resume that fell back) are left alone
    assert retention([(1, True), (2, True), (3, True), (7, False)], 3, 1) == [0, 1]
    with pytest.raises(ValueError, match="keep_last=0"):
        retention([(1, True)], 1, 0)


def test_keep_last_leaves_exactly_the_newest(tmp_path):
    for it in range(5):
        _save(tmp_path, it, keep_last=3)
    assert _names(tmp_path) == ["iter_000002", "iter_000003", "iter_000004", "latest"]
    assert (tmp_path / "latest").read_text() == "iter_000004"
    for it in range(5, 7):
        _save(tmp_path, it)  # None: keep all
    assert _names(tmp_path) == ["iter_000002", "iter_000003", "iter_000004", "iter_000005",
                                "iter_000006", "latest"]
    # leftovers of a killed save and a killed removal are cleaned at the next save
    _fill(tmp_path / "iter_000009.tmp", 9)
    _fill(tmp_path / "iter_000002.del", 2)
    _save(tmp_path, 7, keep_last=1)
    assert _names(tmp_path) == ["iter_000007", "latest"]


def test_resume_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    assert find_checkpoint(tmp_path) is None and find_checkpoint(tmp_path / "none") is None
    for it in (1, 2, 3):
        _published(tmp_path, it)
    found = find_checkpoint(tmp_path)
    assert found.path.name == "iter_000003" and found.state["iteration"] == 3
    assert found.message() is None
    loop = tmp_path / "iter_000003" / "loop.json"
    loop.write_text(loop.read_text()[:7])  # truncated by a kill or a full disk
    (tmp_path / "iter_000002" / ".metadata").unlink()  # a partial copy
    found = find_checkpoint(tmp_path)
    assert found.path.name == "iter_000001" and found.state == {"iteration": 1, "payload": "w"}
    msg = found.message()
    assert msg.startswith(f"resuming from {tmp_path / 'iter_000001'}, the newest complete")
    assert f"{loop} is truncated or not JSON" in msg
    assert f"{tmp_path / 'iter_000002' / '.metadata'} is missing" in msg
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_000001"
    # nothing complete remains: one error naming each file, and the fix
    shutil.rmtree(tmp_path / "iter_000001")
    with pytest.raises(CheckpointError) as e:
        find_checkpoint(tmp_path)
    text = str(e.value)
    assert text.startswith(f"no complete checkpoint under {tmp_path}: ")
    assert str(loop) in text and "delete" in text and "run.output_dir" in text


def test_damage_names_the_file(tmp_path):
    d = tmp_path / "iter_000004"
    _fill(d, 4)
    assert damage(d) is None
    (d / "loop.json").write_text("[1, 2]")
    assert damage(d) == f"{d / 'loop.json'} holds a list, not the loop state"
    (d / "loop.json").unlink()
    assert damage(d).startswith(f"{d / 'loop.json'} is missing: {d} is an incomplete")
    with pytest.raises(CheckpointError, match="loop.json is missing"):
        ck.read_loop_state(d)


def test_every_file_and_folder_is_fsynced_before_the_rename_that_publishes_it(tmp_path,
                                                                               monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(a), str(b)))
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _save(tmp_path, 0)
    tmp, final = tmp_path / "iter_000000.tmp", tmp_path / "iter_000000"
    publish = events.index(("replace", str(tmp), str(final)))
    before = {e[1] for e in events[:publish] if e[0] == "fsync"}
    for name in ("loop.json", "metadata.json", ".metadata", "__0_0.distcp"):
        assert str(tmp / name) in before, name
    assert str(tmp) in before
    marker = events.index(("replace", str(tmp_path / "latest.tmp"), str(tmp_path / "latest")))
    assert ("fsync", str(tmp_path / "latest.tmp")) in events[publish:marker]
    # the root folder (which holds the new names) after each rename
    assert ("fsync", str(tmp_path)) in events[publish:marker]
    assert events[marker + 1] == ("fsync", str(tmp_path))


@pytest.mark.parametrize("fail_at", range(8))
def test_a_resave_of_latest_keeps_a_complete_checkpoint_at_every_step(tmp_path, monkeypatch,
                                                                      fail_at):
    """Re-save iteration 5 (latest) with new weights; fail its fail_at-th filesystem change.
    Before every change, and after the failure, a complete checkpoint of iteration 5 exists
    and is the one a resume picks; with no failure the new one replaced the old."""
    _published(tmp_path, 4, "older")
    _published(tmp_path, 5, "old")
    steps = []
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def guarded(real):
        def op(*args, **kw):
            found = find_checkpoint(tmp_path)
            assert found.path.name.startswith("iter_000005"), found
            assert found.state["payload"] in ("old", "new")
            steps.append(args[0])
            if len(steps) - 1 == fail_at:
                raise OSError(f"injected failure at step {fail_at}")
            return real(*args, **kw)
        return op

    tmp = tmp_path / "iter_000005.tmp"
    _fill(tmp, 5, "new")
    monkeypatch.setattr(ck.os, "replace", guarded(real_replace))
    monkeypatch.setattr(ck.shutil, "rmtree", guarded(real_rmtree))
    try:
        ck._publish(tmp, tmp_path / "iter_000005", 2, 5)
        failed = False
    except OSError:
        failed = True
    monkeypatch.undo()
    found = find_checkpoint(tmp_path)
    assert found.state["iteration"] == 5 and damage(found.path) is None
    if failed:
        assert found.state["payload"] in ("old", "new")
    else:
        assert found.state["payload"] == "new" and found.message() is None
        assert _names(tmp_path) == ["iter_000004", "iter_000005", "latest"]
    # the re-save makes 7 changes (see checkpoint.py's diagram): fail_at 7 is the uninterrupted
    assert failed == (fail_at < 7) and len(steps) == (fail_at + 1 if failed else 7), steps


def test_a_resave_interrupted_mid_swap_resumes_from_the_old_copy(tmp_path):
    # what a kill between "iter_N -> iter_N.old" and "iter_N.tmp -> iter_N" leaves
    _published(tmp_path, 5, "old")
    os.replace(tmp_path / "iter_000005", tmp_path / "iter_000005.old")
    _fill(tmp_path / "iter_000005.tmp", 5, "new")
    found = find_checkpoint(tmp_path)
    assert found.path.name == "iter_000005.old" and found.state["payload"] == "old"
    assert "latest names" in found.message() and "does not exist" in found.message()
    # the next save of that iteration publishes normally and removes the old copy
    _save(tmp_path, 5, keep_last=3, payload="new")
    assert _names(tmp_path) == ["iter_000005", "latest"]
    assert find_checkpoint(tmp_path).state["payload"] == "new"


def test_keep_last_is_range_checked():
    assert RunConfig().keep_last == 3 and RunConfig(keep_last=None).keep_last is None
    with pytest.raises(ConfigError, match=r"run.keep_last=0 would keep no checkpoint: use >= 1, "
                                          r"or null to keep every checkpoint"):
        RunConfig(keep_last=0)


def test_a_new_run_is_refused_where_a_run_lives(tmp_path):
    assert earlier_run(tmp_path / "fresh") is None
    (tmp_path / "resolved.json").write_text("{}")     # written before the check: not a run
    (tmp_path / "metrics.jsonl").write_text("")       # a run killed before its first line
    assert earlier_run(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (tmp_path / "checkpoints" / "iter_000000").mkdir(parents=True)
    msg = earlier_run(tmp_path)
    assert msg == (f"run.output_dir={tmp_path} already holds a run (metrics.jsonl, checkpoints/) "
                   "and run.resume=false would overwrite it: set run.resume=true to continue "
                   f"that run, choose a new run.output_dir, or delete {tmp_path} to start over")
