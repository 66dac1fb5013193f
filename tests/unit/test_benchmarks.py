"""Every benchmark starts as its docs say: ``python benchmarks/NAME.py`` from the repository root,
nothing on PYTHONPATH (a newcomer's shell).

Python puts the script's folder (benchmarks/), not the root, first on sys.path; each benchmark
puts the root first itself. Without that, ``benchmarks.async_rl:slow_tool`` (an environment the
worker processes import by name) failed with "No module named 'benchmarks'", and the benchmark
imported whatever earl_megatron was installed rather than this checkout's.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# sglang_bench.py is a module of rollout.py (its SGLang sections), not a script
BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "sglang_bench.py")


def _run(args, timeout):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_every_benchmark_is_listed():
    """The list below is the folder's: a new benchmark is tested without editing this file."""
    assert "async_rl.py" in BENCHMARKS and "weight_sync.py" in BENCHMARKS
    assert len(BENCHMARKS) == 16, BENCHMARKS


@pytest.mark.parametrize("name", BENCHMARKS)
def test_help_and_imports_from_the_root(name):
    """One interpreter per benchmark, started as a newcomer's shell starts it: the script run
    as ``__main__`` with ``--help`` (sys.path[0] and argv[0] as ``python benchmarks/NAME.py
    --help`` sets them) exits 0 with argparse's usage line naming the script; after it
    ``earl_megatron`` is this repository's, whatever is installed, and ``benchmarks.<name>``
    imports too (the name workers use)."""
    code = (f"import contextlib, importlib, io, runpy, sys; sys.path[0] = "
            f"{str(ROOT / 'benchmarks')!r}; sys.argv = ['benchmarks/{name}', '--help']\n"
            "out = io.StringIO()\n"
            "try:\n"
            "    with contextlib.redirect_stdout(out):\n"
            f"        runpy.run_path('benchmarks/{name}', run_name='__main__')\n"
            "    status = 'no exit'\n"
            "except SystemExit as e:\n"
            "    status = e.code\n"
            "import earl_megatron\n"
            f"importlib.import_module('benchmarks.{name[:-3]}')\n"
            "print(repr(status)); print(repr(out.getvalue())); print(earl_megatron.__file__)")
    proc = _run(["-c", code], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, usage, where = proc.stdout.strip().splitlines()[-3:]
    assert status in ("0", "None"), (status, proc.stderr[-2000:])
    assert ast.literal_eval(usage).startswith(f"usage: {name} "), usage[:500]
    assert where == str(ROOT / "earl_megatron" / "__init__.py")


@pytest.mark.distributed
def test_async_rl_env_section_runs():
    """The cheapest real run of the benchmark that failed: its user-environment section on 2
    gloo ranks (1 measured iteration, 1-turn episodes), whose workers import
    ``benchmarks.async_rl:slow_tool`` by name. Its table prints the three rollout rows."""
    proc = _run(["benchmarks/async_rl.py", "--section", "env", "--env-iterations", "2",
                 "--turns", "1"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "env.name=benchmarks.async_rl:slow_tool" in proc.stdout
    for row in ("zero latency", "concurrency 1 ", "concurrency 16"):
        assert row in proc.stdout, proc.stdout
