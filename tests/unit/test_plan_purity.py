"""Every module of plan/ (and config/model.py) imports neither torch nor megatron, in a fresh
interpreter. The list is discovered, not written down: a new plan module is covered at once."""

import pathlib
import subprocess
import sys

import earl_megatron.plan

PURE = sorted(f"earl_megatron.plan.{p.stem}"
              for p in pathlib.Path(earl_megatron.plan.__file__).parent.glob("*.py")
              if p.stem != "__init__") + ["earl_megatron.config.model"]


def test_discovery_finds_the_planning_modules():
    assert {"earl_megatron.plan.tensor_table", "earl_megatron.plan.shard_map",
            "earl_megatron.plan.placement", "earl_megatron.plan.state_plan"} <= set(PURE)


def test_plan_modules_import_no_torch_or_megatron():
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in PURE)
            + "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
              "('torch', 'megatron', 'transformer_engine'))\n"
              "print(len(bad), bad[:5])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "0", proc.stdout
