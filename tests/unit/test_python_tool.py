"""The Python tool (envs/python_tool.py) and reasoning-gym's multi-turn mode with it
(envs/python_turns.py, envs/reasoning_gym_env.py ``tool=python``): real programs in real
processes, each limit hit for real."""

import json
import os
import socket

import pytest

from earl_megatron.envs import python_tool
from earl_megatron.envs.python_tool import PythonLimits, PythonSandbox
from earl_megatron.envs.registry import make_env
from earl_megatron.envs.tool_calls import call_text

TASKS = ["basic_arithmetic", "chain_sum", "leg_counting", "letter_counting"]
"""recipes/smollm2_reasoning_gym.yaml's tasks."""


def test_a_program_prints_and_a_failure_says_why():
    box = PythonSandbox()
    assert box.run("print(17 * 23)") == python_tool.PythonResult("391", True)
    assert box.run("print(1)\nprint(2)\n1 / 0") == \
        python_tool.PythonResult("1\n2\nZeroDivisionError: division by zero", False)
    assert box.run("input()").output.endswith("EOFError: EOF when reading a line")   # no stdin
    assert box.run("pass") == python_tool.PythonResult("", True)


def test_each_limit_stops_the_program_and_says_which():
    # CPU time, not wall time: the same loop is stopped after the same work on any host (the
    # wall guard is set far above it here so that only the CPU limit can decide)
    spin = PythonSandbox(PythonLimits(cpu_seconds=1, wall_seconds=120)).run("while True: pass")
    assert spin == python_tool.PythonResult("stopped by the CPU time limit", False)
    big = PythonSandbox(PythonLimits(memory_mb=128)).run("x = bytearray(512 << 20)")
    assert big == python_tool.PythonResult("MemoryError", False)
    flood = PythonSandbox(PythonLimits(output_bytes=4096, output_chars=100)).run(
        "import sys\nsys.stdout.write('x' * 100000)")
    assert not flood.ok and flood.output.startswith("x" * 100 + "\n[output cut at 100 ")
    assert flood.output.endswith("File too large"), flood.output
    sleeper = PythonSandbox(PythonLimits(wall_seconds=0.5)).run("import time\ntime.sleep(60)")
    assert sleeper == python_tool.PythonResult("stopped: no result within 0.5 s", False)
    with pytest.raises(ValueError, match="cpu_seconds=0 must be an integer >= 1"):
        PythonLimits(cpu_seconds=0)


def test_nothing_of_the_caller_reaches_the_program(monkeypatch, tmp_path):
    monkeypatch.setenv("EARL_SECRET", "do-not-leak")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.txt").write_text("caller's file")
    seen = PythonSandbox().run("import os, json\n"
                               "print(json.dumps([sorted(os.environ), os.getcwd(), "
                               "os.listdir('.')]))")
    env, cwd, files = json.loads(seen.output)
    assert "EARL_SECRET" not in env and cwd != str(tmp_path), seen
    assert sorted(files) == ["main.py", "stderr", "stdout"], seen   # its own directory
    assert not os.path.exists(cwd)   # removed after the run


def test_no_connection_leaves_its_network_namespace():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)"
        isolated = PythonSandbox().run(code)
        assert not isolated.ok and "OSError" in isolated.output, isolated
        assert PythonSandbox(PythonLimits(network=True)).run(code).ok   # the control
    finally:
        server.close()


def test_a_host_without_user_namespaces_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(python_tool, "_unshare_works", lambda: False)
    with pytest.raises(ValueError, match=r"set network=true in the tool's limits \(env.kwargs"):
        PythonSandbox().check_isolation()
    PythonSandbox(PythonLimits(network=True)).check_isolation()   # no namespace asked for
    with pytest.raises(ValueError, match="env.kwargs.python"):
        make_env("reasoning_gym", tasks=["basic_arithmetic"], tool="python")


def _call(code):
    return call_text("python", "code", code)


def test_reasoning_gym_with_the_tool_runs_programs_then_scores_the_answer():
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    env = make_env("reasoning_gym", tasks=["basic_arithmetic"], size=20, tool="python",
                   max_tool_calls=2)
    assert env.system_prompt.endswith("</tool_call>") and '"name": "python"' in env.system_prompt
    env.reset(3)
    gold, expr = env.entry["answer"], env.entry["metadata"]["expression"]
    first = env.step(_call(f"print(round({expr}))"))
    assert (first.observation, first.reward, first.done, first.role) == (gold, 0.0, False, "tool")
    assert first.info == {"tool_calls": 1}
    failed = env.step(_call("print(undefined)"))   # the agent's mistake: the episode goes on
    assert failed.observation == "NameError: name 'undefined' is not defined"
    assert failed.info == {"tool_calls": 2, "tool_error": True} and not failed.done
    reply = f"The result is <answer>{gold}</answer>"
    end = env.step(reply)
    score = reasoning_gym.get_score_answer_fn("basic_arithmetic")(extract_answer(reply),
                                                                  env.entry)
    assert (end.reward, end.done, end.info["tool_calls"]) == (score, True, 2) and score == 1.0
    env.reset(3)   # no tag after a call: unparsable, scored 0 as without the tool, counted
    env.step(_call("print(1)"))
    none = env.step("I think it is 3")
    assert (none.reward, none.done, none.info["unparsable"], none.info["tool_calls"]) == \
        (0.0, True, True, 1)
    # the budget: a third call ends the episode with reward 0
    env.reset(3)
    env.step(_call("print(1)"))
    env.step(_call("print(2)"))
    spent = env.step(_call("print(3)"))
    assert (spent.reward, spent.done, spent.info) == (0.0, True, {"tool_budget": True,
                                                                   "tool_calls": 2})


@pytest.mark.parametrize("action, why", [
    ("<tool_call>{not json}</tool_call>", "error: the tool call is not valid JSON"),
    (call_text("bash", "code", "ls"), "error: unknown tool 'bash'; the only tool is python"),
    (call_text("python", "expression", "1+1"), 'error: the arguments are exactly {"code"'),
    ("<tool_call>{\"name\": \"python\"", "error: <tool_call> is not closed"),
])
def test_a_malformed_call_ends_the_episode_as_invalid(action, why):
    env = make_env("reasoning_gym", tasks=["basic_arithmetic"], size=20, tool="python",
                   invalid_penalty=-0.5)
    env.reset(0)
    r = env.step(action)
    assert r.observation.startswith(why) and r.role == "tool", r
    assert (r.reward, r.done) == (-0.5, True)
    assert r.info["tool_error"] and r.info["malformed_call"] and r.info["tool_calls"] == 0


def test_the_experts_programs_print_the_gold_answer_and_score_one():
    """The warm start's teacher with the tool: on the recipe's tasks a program where it knows
    one (arithmetic, letter counting), played through the environment: the tool prints the gold
    answer and the reply scores 1.0 by reasoning-gym's scoring."""
    env = make_env("reasoning_gym", tasks=TASKS, size=200, tool="python")
    used = set()
    for seed in range(40):
        env.reset(seed)
        actions, task = env.expert(seed), env.entry["metadata"]["source_dataset"]
        for action in actions[:-1]:
            r = env.step(action)
            assert (r.observation, r.role) == (env.entry["answer"], "tool"), (task, action, r)
            used.add(task)
        assert env.step(actions[-1]).reward == 1.0, (task, actions)
    assert used == {"basic_arithmetic", "chain_sum", "letter_counting"}   # leg counting: none
    # without the tool: one turn, the prompt unchanged
    plain = make_env("reasoning_gym", tasks=TASKS, size=200)
    assert all(len(plain.expert(s)) == 1 for s in range(40))
    assert env.system_prompt.startswith(plain.system_prompt) and \
        "python" not in plain.system_prompt


@pytest.mark.parametrize("kwargs, message", [
    ({"tool": "bash"}, "env.kwargs.tool='bash': the one tool is python"),
    ({"tool": "python", "max_tool_calls": 0}, "env.kwargs.max_tool_calls=0 must be"),
    ({"tool": "python", "python": {"cpu": 1}}, r"env.kwargs.python has unknown limit\(s\) "
                                               r"\['cpu'\]"),
    ({"tool": "python", "python": {"memory_mb": -1}}, "memory_mb=-1 must be an integer >= 1"),
])
def test_bad_tool_settings_say_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_env("reasoning_gym", tasks=["basic_arithmetic"], **kwargs)
