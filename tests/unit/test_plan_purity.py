"""The planning modules import neither torch nor megatron (checked in a fresh interpreter)."""

import subprocess
import sys

PURE = ["earl_megatron.plan.layout", "earl_megatron.plan.reshard_plan", "earl_megatron.plan.specs", "earl_megatron.plan.presets",
        "earl_megatron.plan.memory_model", "earl_megatron.plan.time_model",
        "earl_megatron.plan.profile_table", "earl_megatron.plan.selector",
        "earl_megatron.config.model"]


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
