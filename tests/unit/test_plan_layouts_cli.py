"""tools/plan_layouts.py: the paper's setting (Qwen2.5-72B on 16 x 8 H100-80GB, 200 Gbps)."""

import importlib.util
import io
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
    assert "72.71B parameters on 16x8 H100, 200 Gbps (128 devices, budget 67.1 GiB" in text
    for stage in ("rollout", "logprob", "train"):
        assert f"{stage}: chosen layout" in text
    lines = text.splitlines()
    # 128K tokens of training does not fit 72B on 128 GPUs without recompute: the last table's
    # 128K row is all OOM, and the hint names fixes that were checked.
    train_128k = [ln for ln in lines if ln.startswith("│ 128K")][-1]
    assert train_128k.count("OOM") == 2 and "TP" not in train_128k
    assert "train 128K: would fit with" in text and "recompute=full" in text
    train_1k = [ln for ln in lines if ln.startswith("│ 1K")][-1]
    assert train_1k.count("TP") == 2 and "/90 OOM" in train_1k
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    assert isinstance(grid[(Stage.TRAIN, 131072, 8)], NoLayoutFitsError)
    assert tool.cell_text(grid[(Stage.TRAIN, 131072, 8)]) == "OOM"


def test_flags_override_the_preset(tool):
    args = tool.build_parser().parse_args(["--model", "llama3-8b", "--layers", "16",
                                           "--cluster", "cpu", "--gpus-per-node", "4",
                                           "--gpu-mem-gb", "2"])
    assert tool.model_from_args(args).num_layers == 16
    cl = tool.cluster_from_args(args)
    assert cl.world_size == 4 and cl.device_memory_bytes == 2 * 10 ** 9
    with pytest.raises(KeyError, match="known presets"):
        tool.model_from_args(tool.build_parser().parse_args(["--model", "gpt5"]))
