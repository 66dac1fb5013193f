"""tools/slurm_local.sh without a Slurm: its directory is private and `down` kills only its own
daemons.

- ``EARL_SLURM_DIR`` that others may write, or that another user owns, is refused by ``up``
  (exit 2, one line naming the problem and the fix) before anything is installed or started.
- ``down`` with pid files that name processes which are not the daemons ``up`` started (a
  recycled pid: here a ``sleep``) leaves those processes alive and removes the stale pid files.
- ``env``/``down`` find the directory the last ``up`` recorded (``~/.cache/earl-slurm/current``)
  when ``EARL_SLURM_DIR`` is unset; nothing is recorded, nothing is stopped.
"""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "slurm_local.sh"


def _run(*args, env=None, home=None):
    e = {k: v for k, v in os.environ.items() if k != "EARL_SLURM_DIR"}
    e.update(env or {})
    if home is not None:
        e["HOME"] = str(home)
    return subprocess.run(["bash", str(SCRIPT), *args], env=e, capture_output=True, text=True,
                          check=False, timeout=60)


def test_up_refuses_a_directory_others_can_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    r = _run("up", env={"EARL_SLURM_DIR": str(shared)}, home=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"slurm_local: EARL_SLURM_DIR={shared} is writable by others (mode 777): chmod 0700 it"]
    assert list(shared.iterdir()) == [] and r.stdout == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_up_refuses_a_directory_of_another_user(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    r = _run("up", env={"EARL_SLURM_DIR": str(theirs)}, home=tmp_path)
    assert r.returncode == 2
    assert "is owned by uid 65534" in r.stderr and "use a directory of your own" in r.stderr


def test_down_leaves_alone_processes_that_are_not_its_daemons(tmp_path):
    mine = tmp_path / "slurm"
    mine.mkdir(mode=0o700)
    sleepers = [subprocess.Popen(["sleep", "300"]) for _ in range(4)]
    try:
        names = ["slurmctld.pid", "slurmd-n1.pid", "slurmd-n2.pid", "munged.pid"]
        for name, p in zip(names, sleepers):
            (mine / name).write_text(f"{p.pid}\n")
        r = _run("down", env={"EARL_SLURM_DIR": str(mine)}, home=tmp_path)
        assert r.returncode == 0, r.stderr
        assert [p.poll() for p in sleepers] == [None] * 4   # all still running
        assert r.stderr.count("left alone") == 4
        assert not any((mine / n).exists() for n in names)   # stale pid files removed
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_env_and_down_without_a_recorded_directory(tmp_path):
    r = _run("env", home=tmp_path)
    assert r.returncode == 2 and "tools/slurm_local.sh up" in r.stderr
    r = _run("down", home=tmp_path)
    assert r.returncode == 0 and "nothing to stop" in r.stderr
    # a recorded directory is found without EARL_SLURM_DIR
    rec = tmp_path / ".cache" / "earl-slurm"
    rec.mkdir(parents=True)
    (rec / "current").write_text(str(tmp_path / "slurm") + "\n")
    r = _run("env", home=tmp_path)
    assert r.returncode == 0
    assert r.stdout.strip() == (f"export EARL_SLURM_DIR={tmp_path / 'slurm'} "
                                f"SLURM_CONF={tmp_path / 'slurm' / 'slurm.conf'}")


def _helpers():
    import importlib.util
    path = SCRIPT.parents[1] / "tests" / "slurm" / "slurm_helpers.py"
    spec = importlib.util.spec_from_file_location("slurm_helpers_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flaky(tmp_path, failures: int, words: str) -> list[str]:
    """A command that fails ``failures`` times with Slurm's ``words`` on stderr, then answers."""
    count = tmp_path / "calls"
    return ["bash", "-c", f'n=$(( $(cat {count} 2>/dev/null || echo 0) + 1 )); echo $n > {count}; '
            f'if (( n <= {failures} )); then echo "{words}" >&2; exit 1; fi; echo JobState=RUNNING']


def test_slurm_queries_retry_a_controller_that_did_not_answer(tmp_path):
    h = _helpers()
    # two socket timeouts, then the answer: the caller sees the answer
    out = h.query(_flaky(tmp_path, 2, "slurm_load_jobs error: Socket timed out on send/recv "
                                      "operation"), tries=3, pause_s=0)
    assert (out.returncode, out.stdout.strip()) == (0, "JobState=RUNNING")
    assert (tmp_path / "calls").read_text().strip() == "3"
    # more timeouts than tries: one error naming the command and Slurm's words
    (tmp_path / "calls").unlink()
    with pytest.raises(RuntimeError, match=r"the Slurm controller did not answer in 3 tries 0 s "
                                           r"apart \(last: slurm_load_jobs error: Socket timed "
                                           r"out\)"):
        h.query(_flaky(tmp_path, 9, "slurm_load_jobs error: Socket timed out"), tries=3,
                pause_s=0)
    # any other error is not retried: returned once for the caller to assert on
    (tmp_path / "calls").unlink()
    out = h.query(_flaky(tmp_path, 9, "slurm_load_jobs error: Invalid job id specified"),
                  tries=3, pause_s=0)
    assert out.returncode == 1 and "Invalid job id" in out.stderr
    assert (tmp_path / "calls").read_text().strip() == "1"


def test_the_local_slurm_waits_for_a_loaded_host():
    # tools/slurm_local.sh's slurm.conf: a message timeout above Slurm's 10 s default, and an
    # unkillable-step timeout at least 5 x that (Slurm's own floor)
    conf = dict(line.split('"', 2)[1].split("=", 1) for line in SCRIPT.read_text().splitlines()
                if line.strip().startswith('echo "') and "Timeout=" in line)
    assert int(conf["MessageTimeout"]) >= 60
    assert int(conf["UnkillableStepTimeout"]) >= 5 * int(conf["MessageTimeout"])
    assert _helpers().QUERY_TIMEOUT_S > int(conf["MessageTimeout"])
