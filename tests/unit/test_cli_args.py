"""``earl train``'s command line split into torchrun's arguments and the trainer's (pure)."""

import pytest

from earl_megatron.cli import launcher_and_trainer_args


def test_split_by_torchrun_options_and_hydra_overrides():
    launcher, trainer = launcher_and_trainer_args(
        ["--nproc-per-node", "4", "--standalone", "model.num_layers=2", "--max_restarts=1",
         "--config-name", "tool_use", "+env.kwargs.x=1", "-cn=other", "~run.seed",
         "--rdzv-endpoint", "n1:29500"])
    assert launcher == ["--nproc-per-node", "4", "--standalone", "--max_restarts=1",
                        "--rdzv-endpoint", "n1:29500"]
    assert trainer == ["model.num_layers=2", "--config-name", "tool_use", "+env.kwargs.x=1",
                       "-cn=other", "~run.seed"]


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node"], "--nproc-per-node needs a value"),
    (["--bogus", "1"], "--bogus: not a torchrun option"),
    (["-m", "x"], "-m: earl train always runs -m earl_megatron.train"),
    (["--no-python"], "--no-python: earl train always runs"),
])
def test_bad_arguments_name_themselves(argv, message):
    with pytest.raises(ValueError, match=message):
        launcher_and_trainer_args(argv)


def test_the_failure_line_quotes_the_rank_that_said_why(tmp_path):
    # a layout that stops fitting mid-run: rank 0 prints the reason, every rank exits 2, and
    # torchrun may see rank 1 (whose log is empty) fail first
    from types import SimpleNamespace

    from earl_megatron.cli import failure_line

    logs = {}
    for r, text in ((0, "warning: x\nlayout error: no layout fits stage rollout\n"), (1, "")):
        d = tmp_path / "run" / "attempt_0" / str(r)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text(text)
        logs[r] = d / "stderr.log"

    def failure(r, code):
        return SimpleNamespace(exitcode=code, error_file=None, local_rank=r, pid=100 + r)

    def error(codes):
        fails = {r: failure(r, c) for r, c in codes.items()}
        return SimpleNamespace(failures=fails, get_first_failure=lambda: (1, fails[1]))

    line = failure_line(error({0: 2, 1: 2}), tmp_path)
    assert line == (f"earl train: rank 0 (pid 100) exited with status 2: layout error: no "
                    f"layout fits stage rollout; log {logs[0]}")
    # a rank that was killed is the cause, whatever the others logged
    line = failure_line(error({0: -15, 1: -9}), tmp_path)
    assert line == f"earl train: rank 1 (pid 101) was killed by SIGKILL; log {logs[1]}"


# a rank's stderr log as Hydra leaves it (the warm start of a game without expert, before the
# pre-launch check refused it): the traceback, then Hydra's hint as the last line
HYDRA_LOG = """\
Error executing job with overrides: ['sft.steps=4']
Traceback (most recent call last):
  File "/w/earl_megatron/trainer/warm_start.py", line 86, in run
    traces = load_traces(self.scfg, self.source.env, self.source.env_kwargs, self.source.seed)
             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/w/earl_megatron/envs/base.py", line 100, in expert
    raise NotImplementedError(f"environment {self.name!r} has no scripted expert; give the "
NotImplementedError: environment 'connect_four' has no scripted expert; give the warm start a \
JSONL file (sft.data=PATH)

Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
"""


def test_the_last_error_is_the_exception_line_not_hydras_hint():
    from earl_megatron.cli import last_error

    assert last_error(HYDRA_LOG) == ("NotImplementedError: environment 'connect_four' has no "
                                     "scripted expert; give the warm start a JSONL file "
                                     "(sft.data=PATH)")
    # a chain of exceptions: the last one is the rank's error
    chained = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n"
               "KeyError: 'x'\n\nDuring handling of the above exception, another exception "
               "occurred:\n\nTraceback (most recent call last):\n  File \"a.py\", line 3, in f\n"
               "ValueError: bad x\n")
    assert last_error(chained) == "ValueError: bad x"
    # no traceback: the last line that is not Hydra's hint; nothing said: None
    assert last_error("warning: y\nconfiguration error: z\n") == "configuration error: z"
    assert last_error("\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack "
                      "trace.\n") is None
    assert last_error("") is None


def test_the_pre_launch_check_does_not_import_megatron():
    # `earl train` checks the config before any rank starts; Megatron-Core's import (7-10 s of
    # a core on the CI host) is the ranks' to pay, not the check's (trainer/warm_start.py,
    # trainer/agent_rollout.py agent_spec)
    import subprocess
    import sys

    code = ("import sys\nfrom earl_megatron.cli import check_config\n"
            "for args in ([], ['env.name=agent'], ['sft.steps=2', 'sft.data=tests/data/none']):\n"
            "    try:\n        check_config(args, 2, 2)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('megatron')))\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ,
                                                      "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]
