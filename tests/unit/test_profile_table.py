"""Profile table: recording, interpolation, scale factors, JSON round trip and errors."""

import json
import math

import pytest

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.profile_table import SCHEMA_VERSION, ProfileTable, ProfileTableError
from earl_megatron.plan.selector import Selector, SelectorConfig
from earl_megatron.plan.specs import ClusterSpec, Stage, StageWorkload

TP2 = ParallelLayout(tp=2, dp=2)
PP2 = ParallelLayout(pp=2, dp=2)


def _table() -> ProfileTable:
    t = ProfileTable()
    t = t.record(Stage.TRAIN, TP2, 1024, 8, 1.0)
    t = t.record(Stage.TRAIN, TP2, 4096, 8, 3.0)
    t = t.record(Stage.TRAIN, TP2, 1024, 32, 4.0)
    return t


def test_record_is_pure_and_replaces_same_key():
    empty = ProfileTable()
    t = empty.record(Stage.TRAIN, TP2, 1024, 8, 1.0)
    assert empty.entries == () and len(t.entries) == 1
    t2 = t.record(Stage.TRAIN, TP2, 1024, 8, 2.0)
    assert len(t2.entries) == 1 and t2.entries[0].seconds == 2.0
    with pytest.raises(ProfileTableError, match="positive finite"):
        t.record(Stage.TRAIN, TP2, 1024, 8, float("nan"))


def test_lookup_interpolates_in_log_context_and_load():
    t = _table()
    assert t.lookup(Stage.TRAIN, TP2, 1024, 8) == 1.0
    assert t.lookup(Stage.TRAIN, TP2, 2048, 8) == pytest.approx(2.0)    # log2 midpoint
    assert t.lookup(Stage.TRAIN, TP2, 512, 8) == 1.0                     # clamped below
    assert t.lookup(Stage.TRAIN, TP2, 65536, 8) == 3.0                   # clamped above
    assert t.lookup(Stage.TRAIN, TP2, 1024, 16) == pytest.approx(2.5)   # load 8 -> 32 midpoint
    assert t.lookup(Stage.TRAIN, PP2, 1024, 8) is None
    assert t.lookup(Stage.ROLLOUT, TP2, 1024, 8) is None


def test_scale_factor_own_then_stage_mean_then_one():
    t = _table().record(Stage.TRAIN, PP2, 1024, 8, 4.0)
    analytic = {TP2: lambda ctx, load: 0.5, PP2: lambda ctx, load: 1.0}
    f = t.scale_factor(Stage.TRAIN, TP2, 1024, 8, analytic.__getitem__)
    assert f == pytest.approx(2.0)                  # measured 1.0 s / predicted 0.5 s
    other = ParallelLayout(tp=4)
    g = t.scale_factor(Stage.TRAIN, other, 1024, 8, lambda lay: analytic.get(lay, analytic[PP2]))
    assert g == pytest.approx(math.sqrt(2.0 * 4.0))  # geometric mean of TP2 (2x) and PP2 (4x)
    assert t.scale_factor(Stage.LOGPROB, TP2, 1024, 8, analytic.__getitem__) == 1.0


def test_json_round_trip(tmp_path):
    t = _table().with_meta(model="tiny", cluster="cpu 4")
    path = tmp_path / "profile.json"
    t.save(path)
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION
    assert ProfileTable.load(path) == t


def test_bad_files_say_what_is_wrong(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ProfileTableError, match="not valid JSON"):
        ProfileTable.load(path)
    path.write_text(json.dumps({"schema_version": 99, "entries": []}))
    with pytest.raises(ProfileTableError, match="schema_version is 99"):
        ProfileTable.load(path)
    good = _table().to_json()
    del good["entries"][1]["seconds"]
    path.write_text(json.dumps(good))
    with pytest.raises(ProfileTableError, match="entry 1 is malformed.*profile_layouts"):
        ProfileTable.load(path)
    good = _table().to_json()
    good["entries"][0]["stage"] = "warmup"
    with pytest.raises(ProfileTableError, match="entry 0"):
        ProfileTable.from_json(good)


def test_profile_overrides_the_analytic_choice():
    model = ModelConfig.tiny()
    cluster = ClusterSpec.cpu(ranks=4)
    wl = StageWorkload.of(Stage.LOGPROB, 256, 8)
    base = Selector(model, cluster, config=SelectorConfig(hysteresis=0.0))
    plan, _ = base.plan(wl)
    fav = plan.layout
    # Measure the favourite at 100x its prediction and the runner-up exactly as predicted.
    second = plan.runner_up.layout
    table = ProfileTable()
    for lay, factor in ((fav, 100.0), (second, 1.0)):
        table = table.record(Stage.LOGPROB, lay, 256, 8, factor * base.evaluate(lay, wl).time.total)
    calibrated = Selector(model, cluster, config=SelectorConfig(hysteresis=0.0), profile=table)
    plan2, _ = calibrated.plan(wl)
    assert plan2.layout == second
    assert calibrated.evaluate(fav, wl).scale == pytest.approx(100.0)
    assert calibrated.evaluate(second, wl).scale == pytest.approx(1.0)
    # Unmeasured layouts inherit the stage's geometric-mean factor, sqrt(100 x 1) = 10.
    other = next(lay for lay in base.valid_layouts() if lay not in (fav, second))
    assert calibrated.evaluate(other, wl).scale == pytest.approx(10.0)


# ------------------------------------------------------------------ server restarts (SGLang)
def test_restart_entries_latest_wins_round_trip_and_survive_stage_records(tmp_path):
    t = ProfileTable().record_restart("m", 2, 40.0).record_restart("m", 1, 25.0)
    t = t.record_restart("m", 2, 55.0).record_restart("other", 2, 9.0)
    assert t.restart_seconds("m", 2) == 55.0                  # the latest record wins
    assert t.restart_seconds("m", 1) == 25.0 and t.restart_seconds("other", 2) == 9.0
    assert t.restart_seconds("m", 4) is None and t.restart_seconds("x", 1) is None
    assert len(t.restarts) == 3
    # recording a stage time or meta keeps the restarts (a table is one value)
    t2 = t.record(Stage.TRAIN, ParallelLayout(dp=2), 128, 2, 0.5).with_meta(model="tiny")
    assert t2.restarts == t.restarts and len(t2.entries) == 1
    path = tmp_path / "p.json"
    t2.save(path)
    assert json.loads(path.read_text())["restarts"][0] == {"model": "m", "tp": 1,
                                                          "seconds": 25.0}
    assert ProfileTable.load(path) == t2


def test_files_without_restarts_load_and_bad_restarts_are_refused():
    old = _table().to_json()
    del old["restarts"]                                   # a file written before restarts
    assert ProfileTable.from_json(old).restarts == ()
    bad = ProfileTable().record_restart("m", 2, 3.0).to_json()
    del bad["restarts"][0]["tp"]
    with pytest.raises(ProfileTableError, match="restart 0 is malformed.*model, tp, seconds"):
        ProfileTable.from_json(bad)
    for args, what in ((("", 1, 1.0), "model"), (("m", 0, 1.0), "tp"), (("m", True, 1.0), "tp"),
                       (("m", 1, 0.0), "seconds"), (("m", 1, float("nan")), "seconds")):
        with pytest.raises(ProfileTableError, match=what):
            ProfileTable().record_restart(*args)
