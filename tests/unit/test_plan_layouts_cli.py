"""tools/plan_layouts.py: the paper's setting (Qwen2.5-72B on 16 x 8 H100-80GB, 200 Gbps)."""

import importlib.util
import io
import json
from pathlib import Path

import pytest

from earl_megatron.plan.presets import get_preset
from earl_megatron.plan.selector import NoLayoutFitsError, Selector, SelectorState
from earl_megatron.plan.specs import ClusterSpec, Stage, StageWorkload

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plan_layouts.py"
ARGS = ["--model", "qwen2.5-72b", "--nodes", "16", "--gpus-per-node", "8", "--gpu-mem-gb", "80",
        "--inter-node-gbps", "200", "--contexts", "1024,32768,131072", "--in-flight", "8,128"]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("plan_layouts", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_main_prints_a_table_per_stage_and_a_png(tool, tmp_path):
    out = io.StringIO()
    png = tmp_path / "plan.png"
    assert tool.main(ARGS + ["--png", str(png)], out=out) == 0
    text = out.getvalue()
    assert "72.71B parameters on 16x8 H100-80GB, 200 Gbps (128 devices, budget 67.1 GiB" in text
    for stage in ("rollout", "logprob", "train"):
        assert f"{stage}: chosen layout" in text
    lines = text.splitlines()
    # 128K tokens of training fits 72B on 128 GPUs once the selector may recompute (the
    # default, --recompute auto): every train cell has a layout, with full recompute at 128K
    train_128k = [ln for ln in lines if ln.startswith("│ 128K")][-1]
    assert "OOM" not in train_128k and train_128k.count(" full ") >= 2, train_128k
    assert "recompute=auto, micro-batch" in text                 # the header says so
    train_1k = [ln for ln in lines if ln.startswith("│ 1K")][-1]
    # chosen layout, seconds, GiB, then the runner-up and its margin, in both columns
    assert train_1k.count("G |") == 2 and train_1k.count("%") == 2
    assert "runner-up" in text                                   # the legend
    assert "valid layouts exceed the budget (DP128" in text      # which layouts are OOM
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_recompute_long_training_is_oom_and_the_fix_is_named(tool):
    # --recompute none (a run fixed to layout.recompute=none): the 128K train row is all OOM,
    # and the hint names fixes that were checked, recompute=full among them
    out = io.StringIO()
    assert tool.main(ARGS + ["--stages", "train", "--recompute", "none"], out=out) == 0
    text = out.getvalue()
    train_128k = [ln for ln in text.splitlines() if ln.startswith("│ 128K")][-1]
    assert train_128k.count("OOM") == 2 and "TP" not in train_128k
    assert "train 128K: would fit with" in text and "recompute=full" in text


def test_where_nothing_tried_fits_the_fix_is_still_named(tool):
    """A 7B on one GPU at 32K: with SGLang servers holding 0.1 of it, no change the planner
    tries fits ROLLOUT, and the line names the fraction to raise; at 0.8 the checked fixes."""
    one = ["--model", "qwen2.5-7b", "--nodes", "1", "--gpus-per-node", "1", "--stages",
           "rollout", "--contexts", "32768", "--in-flight", "8"]
    out = io.StringIO()
    assert tool.main(one + ["--sglang-mem-fraction", "0.1"], out=out) == 0
    assert ("rollout 32K: nothing tried fits; the servers hold --sglang-mem-fraction 0.1 of "
            "each device: raise it (recipes: 0.8 on cuda), or add devices") in out.getvalue()
    out = io.StringIO()
    assert tool.main(one + ["--sglang-mem-fraction", "0.8"], out=out) == 0
    assert "rollout 32K: would fit with 2 nodes" in out.getvalue()


def test_grid_matches_the_selector(tool):
    model = get_preset("qwen2.5-72b")
    sel = Selector(model, ClusterSpec.h100_80gb(nodes=16, inter_node_gbps=200))
    grid = tool.plan_grid(sel, list(Stage), [1024, 131072], [8], 8192)
    # Cells chain the stages: each is planned switching from the previous stage's layout.
    current, state = None, SelectorState()
    for stage in Stage:
        plan, state = sel.plan(StageWorkload.of(stage, 1024, 8, responses_in_flight=8),
                               current=current, state=state)
        current = plan.layout
        assert grid[(stage, 1024, 8)] == plan
        assert plan.predicted_memory_bytes <= sel.budget_bytes
    assert isinstance(grid[(Stage.TRAIN, 131072, 8)], NoLayoutFitsError)   # recompute none
    assert tool.cell_text(grid[(Stage.TRAIN, 131072, 8)]) == "OOM"
    plan = grid[(Stage.TRAIN, 1024, 8)]
    margin = plan.runner_up.cost / plan.chosen.cost - 1
    assert tool.cell_text(plan).startswith(str(plan.layout) + " ")
    assert tool.cell_text(plan).endswith(f"| {plan.runner_up.layout} {margin:+.1%}")


def test_compare_writes_one_object_per_cell(tool, tmp_path):
    out, path = io.StringIO(), tmp_path / "cmp.json"
    argv = ARGS[:10] + ["--stage", "rollout", "--contexts", "1024,32768", "--responses", "8,128",
                        "--compare", "tp2,tp4,tp8", "--json", str(path)]
    assert tool.main(argv, out=out) == 0
    rows = json.loads(path.read_text())
    assert len(rows) == 2 * 2 * 3
    assert set(rows[0]) >= {"context", "responses", "layout", "fits", "tokens_per_gpu_s",
                            "memory_bytes"}
    cell = {(r["context"], r["responses"], r["layout"]): r for r in rows}
    # TP2 holds 72.7 GB of bf16 weights per GPU: over the 67 GiB budget everywhere
    tp2 = [r for r in rows if r["layout"] == "TP2xDP64"]
    assert tp2 and all(not r["fits"] and r["tokens_per_gpu_s"] is None for r in tp2)
    assert cell[(1024, 8, "TP4xDP32")]["tokens_per_gpu_s"] > \
        cell[(1024, 8, "TP8xDP16")]["tokens_per_gpu_s"]
    assert cell[(32768, 128, "TP4xDP32")]["running_batch"] < 128
    assert "per rollout replica" in out.getvalue() and "OOM" in out.getvalue()
    assert "PER ROLLOUT" in tool.build_parser().format_help()


def test_flags_override_the_preset(tool):
    args = tool.build_parser().parse_args(["--model", "llama3-8b", "--layers", "16",
                                           "--cluster", "cpu", "--gpus-per-node", "4",
                                           "--gpu-mem-gb", "2"])
    assert tool.model_from_args(args).num_layers == 16
    cl = tool.cluster_from_args(args)
    assert cl.world_size == 4 and cl.device_memory_bytes == 2 * 10 ** 9
    with pytest.raises(KeyError, match="known presets"):
        tool.model_from_args(tool.build_parser().parse_args(["--model", "gpt5"]))


def test_split_prints_colocated_against_the_chosen_split(tool):
    out = io.StringIO()
    assert tool.main(["--model", "qwen2.5-72b", "--nodes", "16", "--split", "auto",
                      "--sglang-mem-fraction", "0.8", "--responses", "256",
                      "--micro-batch-tokens", "32768", "--contexts", "8192", "--reasons"],
                     out=out) == 0
    text = out.getvalue()
    assert "rollout on SGLang servers (--mem-fraction-static 0.8)" in text
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("8K"))
    # a split of whole nodes, and how much faster than colocated the model says it is
    split = next(w for w in row.split() if w.endswith(":"))
    n_r, n_t = map(int, split.rstrip(":").split("/"))
    assert n_r + n_t == 128 and n_r % 8 == 0 and row.endswith("x"), row
    assert "fastest of" in text and "colocated: colocated on 128 ranks" in text
    with pytest.raises(SystemExit, match="--split 'half'"):
        tool.main(["--split", "half"], out=io.StringIO())
