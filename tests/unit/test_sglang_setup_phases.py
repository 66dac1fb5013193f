"""tools/sglang_cpu/setup.sh (`make sglang`, minutes of pip) says what it is doing: a timed line
per phase, and pip's own output in between, not swallowed by -q. Run here against an existing
venv whose interpreter is a small script standing in for Python and pip (the real build
downloads ~11 GB): the script itself, its phases, its pip arguments and the stand-in it copies
are the real ones."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$ARGS_LOG"
case "$1" in
  -m) echo "Collecting sglang==0.5.23"; echo "  Downloading sglang-0.5.23-py3-none-any.whl" ;;
  -c) case "$2" in *sysconfig*) echo "$SITE" ;; *) echo "SGLang 0.5.23 ready" ;; esac ;;
esac
"""


def test_setup_prints_timed_phases_and_pips_output(tmp_path):
    venv, site = tmp_path / "venv", tmp_path / "site"
    (venv / "bin").mkdir(parents=True)
    site.mkdir()
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SITE": str(site),
           "ARGS_LOG": str(tmp_path / "args.log")}
    proc = subprocess.run(["bash", str(ROOT / "tools" / "sglang_cpu" / "setup.sh"), str(venv)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    phase = re.compile(r"^\[sglang-cpu \d\d:\d\d\] (.*)$")
    phases = [m[1] for m in map(phase.match, lines) if m]
    assert [p.split(" ")[0] for p in phases] == ["updating", "pip", "installing", "installing",
                                                 "importing", "done"]
    assert phases[1] == "pip install sglang==0.5.23 (~11 GB with its own torch; pip's output " \
                        "follows)"
    # pip's own lines come between its phase and the next one
    pip_at = next(i for i, l in enumerate(lines) if l.endswith("pip's output follows)"))
    assert lines[pip_at + 1:pip_at + 3] == ["Collecting sglang==0.5.23",
                                            "  Downloading sglang-0.5.23-py3-none-any.whl"]
    assert "SGLang 0.5.23 ready" in lines
    pip_args = (tmp_path / "args.log").read_text().splitlines()[0].split()
    assert pip_args == ["-m", "pip", "install", "sglang==0.5.23"]    # no -q
    assert (site / "vllm" / "_custom_ops.py").read_text() == \
        (ROOT / "tools" / "sglang_cpu" / "vllm" / "_custom_ops.py").read_text()
    # the CPU pinning shim for SGLang's LoRA, imported only where its variable says so
    assert (site / "earl_cpu_pinning.py").read_text() == \
        (ROOT / "tools" / "sglang_cpu" / "earl_cpu_pinning.py").read_text()
    pth = (site / "earl_cpu_pinning.pth").read_text()
    assert pth.startswith("import os;") and 'EARL_SGLANG_CPU_PINNING") == "off"' in pth


def test_cpu_pinning_shim_makes_pinning_a_no_op_only_when_asked():
    """tools/sglang_cpu/earl_cpu_pinning.py in a fresh interpreter without a GPU: with
    EARL_SGLANG_CPU_PINNING=off, pinned factories and .pin_memory() give ordinary tensors;
    without it, torch is left as it is (pinning raises here, as it does in SGLang's LoRA)."""
    import os
    import sys

    code = ("import sys, torch; sys.path.insert(0, %r); import earl_cpu_pinning\n"
            "t = torch.zeros(3, pin_memory=True) + torch.tensor([1.0], pin_memory=True)\n"
            "print(t.tolist(), torch.ones(2).pin_memory().tolist())"
            % str(ROOT / "tools" / "sglang_cpu"))
    env = {k: v for k, v in os.environ.items() if k != "EARL_SGLANG_CPU_PINNING"}
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={**env, "EARL_SGLANG_CPU_PINNING": "off"}, timeout=120)
    assert on.returncode == 0, on.stderr
    assert on.stdout.split() == ["[1.0,", "1.0,", "1.0]", "[1.0,", "1.0]"]
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert off.returncode != 0
