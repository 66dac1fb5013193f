"""`make smollm2` (tools/smollm2.py) says what it is doing: a line per phase, here on the
finished, hash-checked directory (the phases of a check that writes nothing), through the
function the tool and the suites call."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tool_prints_a_line_per_phase_and_the_directory(smollm2_dir):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "smollm2.py"), "--out",
                           str(smollm2_dir)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == str(smollm2_dir)          # stdout: the result only
    phases = [re.sub(r"^\[smollm2 \d\d:\d\d\] ", "", l) for l in proc.stderr.splitlines()
              if re.match(r"^\[smollm2 \d\d:\d\d\] ", l)]
    assert phases == ["checking SmolLM2-135M-Instruct.Q4_1.gguf's sha256",
                      f"checking {smollm2_dir} against its MANIFEST.json",
                      "it is complete: nothing to write"]
