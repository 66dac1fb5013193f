"""The run's stop file and the held test environment (one process, no process group).

- The stop file is ``<run.output_dir>/stop`` unless ``$EARL_STOP_FILE`` names another; only a
  text starting with ``requested`` asks to stop (the trainer's ``stopped N`` answer does not).
- ``told_to_stop()`` is the installed control's local state: False with none installed, True
  after SIGTERM or a ``requested`` file, False again once closed.
- ``earl_megatron.testing.envs:held_connect_four`` resolves through the registry's
  ``module:factory`` names; it plays the plain game's moves; once its ``hold_when`` file has
  ``hold_lines`` lines it holds every step until told to stop (``HoldTimeout`` past its limit),
  and never once ``release_when`` exists. Bad ``module:factory`` names are one-line errors.
"""

import os
import signal

import pytest

from earl_megatron.envs import make_env
from earl_megatron.envs.registry import UnknownEnvError, env_factory
from earl_megatron.testing.envs import HeldEnv, HoldTimeout
from earl_megatron.trainer.stop import StopControl, stop_file_for, told_to_stop

HELD = "earl_megatron.testing.envs:held_connect_four"


def test_the_stop_file_lives_in_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("EARL_STOP_FILE", raising=False)
    assert stop_file_for(tmp_path / "run") == tmp_path / "run" / "stop"
    assert StopControl.for_run(tmp_path / "run").stop_file == tmp_path / "run" / "stop"
    monkeypatch.setenv("EARL_STOP_FILE", str(tmp_path / "elsewhere"))
    assert stop_file_for(tmp_path / "run") == tmp_path / "elsewhere"


def test_only_requested_asks_to_stop(tmp_path):
    stop = StopControl.for_run(tmp_path)
    assert not stop.local()                       # no file
    (tmp_path / "stop").write_text("stopped 3\n")
    assert not stop.local()                       # the trainer's own answer
    (tmp_path / "stop").write_text("requested\n")
    assert stop.local()


def test_told_to_stop_follows_the_installed_control(tmp_path):
    assert not told_to_stop()
    before = signal.getsignal(signal.SIGTERM)
    stop = StopControl.for_run(tmp_path).install()
    try:
        assert not told_to_stop()
        os.kill(os.getpid(), signal.SIGTERM)      # handled: sets the flag, nothing else
        assert told_to_stop()
    finally:
        stop.close()
    assert not told_to_stop()
    assert signal.getsignal(signal.SIGTERM) is before   # close() puts back what was there


def _held(tmp_path, **kw):
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    return make_env(HELD, hold_when=str(tmp_path / "metrics.jsonl"), opponent="random", **kw)


def test_held_env_plays_the_plain_game(tmp_path):
    held = make_env(HELD, hold_when=str(tmp_path / "absent"), opponent="random")
    plain = make_env("connect_four", opponent="random")
    assert isinstance(held, HeldEnv) and env_factory(HELD) is not None
    assert held.reset(7) == plain.reset(7)
    for move in "3344":
        a, b = held.step(move), plain.step(move)
        assert a == b
        if a.done:
            break


def test_held_env_holds_until_told_to_stop(tmp_path):
    holding = tmp_path / "holding"
    env = _held(tmp_path, hold_limit_s=0.3, holding_file=str(holding))
    env.reset(0)
    assert not holding.exists()
    with pytest.raises(HoldTimeout, match="has 1 line"):   # nobody asked: it holds, then fails
        env.step("3")
    assert holding.exists()                                 # said so as the hold began
    env = _held(tmp_path, hold_lines=2, hold_limit_s=0.3)
    env.reset(0)
    assert not env.step("3").info.get("illegal")           # one line < hold_lines=2: plays
    stop = StopControl.for_run(tmp_path).install()
    try:
        (tmp_path / "stop").write_text("requested\n")
        env = _held(tmp_path, hold_limit_s=0.3)
        env.reset(0)
        assert env.step("3").observation                    # told to stop: the step is played
    finally:
        stop.close()


def test_held_env_never_holds_once_released(tmp_path):
    (tmp_path / "release").write_text("")
    env = _held(tmp_path, hold_limit_s=0.3, release_when=str(tmp_path / "release"),
                holding_file=str(tmp_path / "holding"))
    env.reset(0)
    assert env.step("3").observation
    assert not (tmp_path / "holding").exists()


def test_module_factory_names_fail_in_one_line():
    with pytest.raises(UnknownEnvError, match="cannot import 'no_such_pkg.mod'"):
        make_env("no_such_pkg.mod:f")
    with pytest.raises(UnknownEnvError, match="has no 'nothing'"):
        make_env("earl_megatron.testing.envs:nothing")
    with pytest.raises(UnknownEnvError, match="'POLL_S' is not callable"):
        make_env("earl_megatron.testing.envs:POLL_S")
    with pytest.raises(UnknownEnvError, match=r"or package.module:factory"):
        make_env("no_such_env")
