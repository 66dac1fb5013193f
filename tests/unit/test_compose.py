"""earl_megatron.config.compose: the run directory a launcher asks for before torchrun starts
(recipes/slurm/train.sbatch puts the stop file there). It is what the trainer's own Hydra
composition makes of run.output_dir: overrides and --config-name count, a relative directory is
taken against the current one, and an error is one line and exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from earl_megatron.config.compose import compose, main, run_dir, split_args
from earl_megatron.config.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def test_run_dir_is_the_trainers_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_dir([]) == tmp_path / "runs" / "cpu_demo"          # recipes/config.yaml
    assert run_dir(["run.output_dir=a/b"]) == tmp_path / "a" / "b"
    assert run_dir(["--config-name", "tool_use"]) == tmp_path / "runs" / "tool_use"
    assert run_dir(["-cn=qwen3-8b", "run.output_dir=/x/y"]) == Path("/x/y")
    # the very configuration the trainer builds from the same arguments
    cfg = TrainConfig.from_dict(OmegaConf.to_container(
        compose(["--config-name", "tool_use", "run.iterations=3"]), resolve=True))
    assert cfg.run.iterations == 3 and cfg.env.name == "calculator"


def test_split_args():
    assert split_args(["a=1", "--config-name", "x", "b=2"])[::2] == ("x", ["a=1", "b=2"])
    with pytest.raises(ValueError, match="--config-name needs a value"):
        split_args(["--config-name"])
    with pytest.raises(ValueError, match="--multirun: only --config-name"):
        split_args(["--multirun"])


def test_errors_are_one_line_exit_2(capsys):
    assert main(["--run-dir", "no.such_key=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("configuration error: Could not override "
                                               "'no.such_key'")
    assert main([]) == 2


def test_the_command_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "earl_megatron.config.compose", "--run-dir",
                          "run.output_dir=r"], cwd=tmp_path, capture_output=True, text=True,
                         check=False, timeout=60, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{tmp_path / 'r'}\n" and out.stderr == ""
