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
    assert [p.split(" ")[0] for p in phases] == ["updating", "pip", "installing", "importing",
                                                 "done"]
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
