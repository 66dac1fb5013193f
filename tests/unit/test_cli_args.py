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
