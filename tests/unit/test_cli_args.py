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
