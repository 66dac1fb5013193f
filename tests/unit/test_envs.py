"""Environments: game outcomes from known move sequences, bad actions, MCTS, the calculator."""

import json
import threading

import pyspiel
import pytest
from hypothesis import given, settings, strategies as st

from earl_megatron.envs import EnvStateError, list_envs, make_env
from earl_megatron.envs.openspiel_games import MCTSOpponent, ScriptedOpponent, parse_move
from earl_megatron.envs.tool_env import (CalcError, CalcUnparsable, CalculatorEnv, make_question,
                                         safe_eval)

# A full-board Connect Four draw found by random play (pyspiel confirms: returns [0, 0]).
C4_DRAW = [int(c) for c in "361313645534311043046626105524515600224220"]


def play(env, agent_moves, seed=0):
    env.reset(seed)
    results = [env.step(str(m)) for m in agent_moves]
    assert all(not r.done for r in results[:-1])
    return results[-1]


def scripted(game, opponent, **kw):
    return make_env(game, opponent=ScriptedOpponent(opponent), **kw)


def test_registry_lists_and_rejects():
    assert {"connect_four", "tic_tac_toe", "calculator"} <= set(list_envs())
    with pytest.raises(KeyError, match="known environments: calculator, connect_four"):
        make_env("chess")
    assert make_env("connect_four", agent_player=1).agent_player == 1


def test_connect_four_render_exact():
    env = scripted("connect_four", [1])
    assert env.reset(0) == "moves:\n" + ".......\n" * 6 + "0123456"
    res = env.step(" 0 because")
    assert res == type(res)("moves: 0 1\n" + ".......\n" * 5 + "xo.....\n0123456", 0.0, False,
                            {})


def test_connect_four_vertical_four_wins():
    res = play(scripted("connect_four", [1, 1, 1]), [0, 0, 0, 0])
    assert (res.reward, res.done, res.info) == (1.0, True, {"outcome": "win"})
    assert res.observation == ("moves: 0 1 0 1 0 1 0\n" + ".......\n" * 2 + "x......\n"
                               + "xo.....\n" * 3 + "0123456\nresult: win")


def test_connect_four_opponent_four_loses():
    res = play(scripted("connect_four", [1, 1, 1, 1]), [0, 5, 0, 5])
    assert (res.reward, res.done, res.info["outcome"]) == (-1.0, True, "loss")


@pytest.mark.parametrize("agent_player", [0, 1])
def test_connect_four_full_board_draws(agent_player):
    state = pyspiel.load_game("connect_four").new_initial_state()
    for a in C4_DRAW:
        state.apply_action(a)
    assert state.is_terminal() and state.returns() == [0.0, 0.0]
    mine, theirs = C4_DRAW[agent_player::2], C4_DRAW[1 - agent_player::2]
    res = play(scripted("connect_four", theirs, agent_player=agent_player), mine)
    assert (res.reward, res.done, res.info["outcome"]) == (0.0, True, "draw")
    assert "." not in res.observation.split("\n")[1]  # top row full


def test_full_column_is_illegal_with_penalty():
    env = scripted("connect_four", [0, 0, 0], invalid_penalty=-0.5)
    res = play(env, [0, 0, 0, 0])
    assert (res.reward, res.done) == (-0.5, True)
    assert res.info == {"illegal": True, "move": 0}
    assert res.observation.endswith("result: illegal")
    with pytest.raises(EnvStateError, match="reset"):
        env.step("1")


@pytest.mark.parametrize("text,flag", [("7", "illegal"), ("9x", "illegal"), ("abc", "unparsable"),
                                       ("", "unparsable"), ("x3", "unparsable"),
                                       ("\n", "unparsable")])
def test_bad_actions_flagged_never_raise(text, flag):
    env = make_env("connect_four", invalid_penalty=-2.0)
    env.reset(3)
    res = env.step(text)
    assert (res.reward, res.done, res.info[flag]) == (-2.0, True, True)


def test_parse_move():
    assert [parse_move(t) for t in ["3", " 4\n", "5 and more", "62", "x", ""]] == \
        [3, 4, 5, 6, None, None]


def test_tic_tac_toe_outcomes_and_digit_board():
    env = scripted("tic_tac_toe", [4], agent_player=1)
    assert env.reset(0) == "moves: 4\n012\n3x5\n678"
    res = play(scripted("tic_tac_toe", [3, 5]), [0, 4, 8])  # diagonal 0-4-8
    assert (res.reward, res.info["outcome"]) == (1.0, "win")
    assert res.observation == "moves: 0 3 4 5 8\nx12\noxo\n67x\nresult: win"
    res = play(scripted("tic_tac_toe", [1, 4, 5, 6]), [0, 2, 3, 7, 8])  # xox/xoo/oxx
    assert (res.reward, res.info["outcome"]) == (0.0, "draw")
    res = play(scripted("tic_tac_toe", [4]), [0, 4])  # cell 4 taken
    assert res.info == {"illegal": True, "move": 4}


def test_random_opponent_is_seeded():
    def opponent_reply(seed):
        env = make_env("connect_four")
        env.reset(seed)
        return env.step("3").observation

    assert opponent_reply(5) == opponent_reply(5)
    assert len({opponent_reply(s) for s in range(12)}) > 1


def state_after(game, moves):
    game = pyspiel.load_game(game)
    state = game.new_initial_state()
    for m in moves:
        state.apply_action(m)
    return game, state


@pytest.mark.parametrize("game,moves,block", [
    ("connect_four", [0, 1, 0, 1, 0], 0),  # x has three in column 0: o must play 0
    ("connect_four", [0, 6, 1, 6, 2], 3),  # x has 0-1-2 on the bottom row: o must play 3
    ("tic_tac_toe", [0, 4, 1], 2),         # x has cells 0 and 1: o must take 2
])
def test_mcts_blocks_immediate_threat(game, moves, block):
    game, state = state_after(game, moves)
    for seed in range(2):
        bot = MCTSOpponent(simulations=300)
        bot.reset(game, seed)
        assert bot.choose(state) == block


def test_mcts_beats_lowest_free_cell_agent():
    env = make_env("tic_tac_toe", opponent="mcts", mcts_simulations=200)
    obs, res = env.reset(0), None
    while res is None or not res.done:
        # the agent takes the lowest free cell; free cells show as digits on the board rows
        res = env.step(min(c for c in "".join(obs.split("\n")[1:4]) if c.isdigit()))
        obs = res.observation
    assert (res.reward, res.info["outcome"]) == (-1.0, "loss")


def test_safe_eval_values_and_rejections():
    assert [safe_eval(e) for e in ["12*(3+4)", "7//2", "-3**2", "2**-1", "17%5", "1.5*4"]] == \
        [84, 3, -9, 0.5, 2, 6.0]
    for bad in ["__import__('os')", "x", "(lambda: 1)()", "[1]*10", "'a'*3", "True+1",
                "().__class__", "1;2", "9" * 250]:
        with pytest.raises(CalcUnparsable):
            safe_eval(bad)
    for refused in ["2**100000", "10**10**10", "1/0", "5%0", "10**20*10**20", "0**-1"]:
        with pytest.raises(CalcError):
            safe_eval(refused)


def test_safe_eval_arithmetic_errors_are_calculator_errors():
    # Python raises OverflowError for 1e-300 ** -64: a refused value, not a crash of the tool
    for expr in ["1e-300**-64", "0.5**-200", "(1e-200*1e-200)**-1", "1e-300**-1"]:
        with pytest.raises(CalcError):
            safe_eval(expr)
    assert safe_eval("1e-300**64") == 0.0 and safe_eval("0.5**-64") == 2.0 ** 64
    # with the bounds raised past a float's range, Python's own OverflowError is caught too
    with pytest.raises(CalcError, match="arithmetic error"):
        safe_eval("2.0**1100", max_magnitude=10 ** 400, max_exponent=2000)


def test_safe_eval_limits_count_operations_not_time():
    from earl_megatron.envs.tool_env import MAX_OPERATIONS

    at_limit = "+".join(["1"] * (MAX_OPERATIONS + 1))  # MAX_OPERATIONS additions
    assert safe_eval(at_limit) == MAX_OPERATIONS + 1
    for over in [at_limit + "+1", "-" * (MAX_OPERATIONS + 1) + "1"]:
        with pytest.raises(CalcError, match=f"more than {MAX_OPERATIONS} operations"):
            safe_eval(over)
    assert safe_eval("-" * MAX_OPERATIONS + "1") == 1
    with pytest.raises(TypeError):  # no clock to configure: the limits are counts
        safe_eval("1+1", time_limit_s=0.05)


def test_calculator_overflow_is_a_tool_error_not_a_tool_failure():
    env = CalculatorEnv(tool_failure_penalty=-0.5)
    env.reset(0)
    res = env.step("<calc>1e-300**-64</calc>")
    assert (res.reward, res.done, res.info) == (0.0, False, {"tool_error": True, "tool_calls": 1})
    assert res.observation == "<error>value exceeds 1e+30</error>"


def test_builtin_calculator_reward_does_not_depend_on_a_clock():
    # the wall-clock guard is for replacement tools only: the built-in calculator runs inline,
    # so even a guard no thread could meet (1 ns) leaves its answers and rewards unchanged
    expr, value = make_question(3)
    for timeout in (1e-9, 1.0):
        env = CalculatorEnv(tool_timeout_s=timeout)
        env.reset(3)
        res = env.step(f"<calc>{expr}</calc>")
        assert (res.observation, res.reward, res.done, res.info) == \
            (f"<result>{value}</result>", 0.0, False, {"tool_calls": 1})


EXPRS = st.recursive(st.integers(0, 999).map(str),
                     lambda sub: st.one_of(
                         st.tuples(sub, st.sampled_from("+-*%"), sub).map(
                             lambda t: f"({t[0]}{t[1]}{t[2]})"),
                         sub.map(lambda e: f"-{e}")), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(EXPRS)
def test_safe_eval_agrees_with_python_on_arithmetic(expr):
    # expr is built only from digits, operators and parentheses, so Python's eval is safe here
    try:
        expected = eval(expr)
    except ZeroDivisionError:
        with pytest.raises(CalcError, match="division by zero"):
            safe_eval(expr)
        return
    assert safe_eval(expr) == expected


def test_calculator_episode():
    env = CalculatorEnv(invalid_penalty=-1.0)
    question = env.reset(7)
    expr, value = make_question(7)
    assert question == f"compute {expr}" and value == safe_eval(expr)
    assert env.reset(7) == question
    res = env.step(f"let me see <calc>{expr}</calc>")
    assert (res.observation, res.reward, res.done) == (f"<result>{value}</result>", 0.0, False)
    res = env.step("<calc>2**100000</calc>")
    assert res.done is False and res.info["tool_error"] and "exponent" in res.observation
    res = env.step(f"<answer>{value}</answer>")
    assert (res.reward, res.done, res.info["correct"], res.info["tool_calls"]) == \
        (1.0, True, True, 2)
    env.reset(7)
    assert env.step(f"<answer>{value + 1}</answer>").reward == 0.0


@pytest.mark.parametrize("text", ["<calc>__import__('os').system('ls')</calc>", "84",
                                  "<answer>eighty</answer>", "<calc>1+2"])
def test_calculator_bad_calls_penalised(text):
    env = CalculatorEnv(invalid_penalty=-0.25)
    env.reset(1)
    res = env.step(text)
    assert (res.reward, res.done, res.info["unparsable"]) == (-0.25, True, True)


def test_calculator_tool_budget():
    env = CalculatorEnv(max_tool_calls=1)
    env.reset(0)
    assert not env.step("<calc>1+1</calc>").done
    res = env.step("<calc>1+1</calc>")
    assert (res.reward, res.done, res.info["tool_budget"]) == (0.0, True, True)


def test_calculator_expert_calls_the_tool_in_about_half_the_episodes():
    from earl_megatron.rollout.trajectories import expert_trajectories

    env = CalculatorEnv()
    assert env.expert(3) == env.expert(3)  # a pure function of the seed
    traces = expert_trajectories(lambda: CalculatorEnv(system_prompt=""), range(400))
    tool = [t for t in traces if t.meta["info"]["tool_calls"] == 1]
    mental = [t for t in traces if t.meta["info"]["tool_calls"] == 0]
    assert len(tool) + len(mental) == 400 and 160 <= len(tool) <= 240
    # with the tool the expert is always right; from mental arithmetic rarely (~10%)
    assert all(t.meta["reward"] == 1.0 for t in tool)
    wrong = [t for t in mental if t.meta["reward"] == 0.0]
    assert 0.8 <= len(wrong) / len(mental) <= 0.97
    # a wrong mental answer is plausible: a number with as many digits as the true value
    for t in wrong[:50]:
        expr, value = make_question(t.meta["seed"])
        guess = t.messages[-1][1][len("<answer>"):-len("</answer>")]
        assert guess.lstrip("-").isdigit() and int(guess) != value
        assert len(guess.lstrip("-")) == len(str(abs(value)))
    assert CalculatorEnv(expert_tool_rate=1.0).expert(5)[0] == f"<calc>{make_question(5)[0]}</calc>"
    assert len(CalculatorEnv(expert_tool_rate=0.0).expert(5)) == 1
    with pytest.raises(ValueError, match="probability"):
        CalculatorEnv(expert_tool_rate=1.5)


def test_games_have_no_expert():
    from earl_megatron.envs import make_env

    with pytest.raises(NotImplementedError, match="sft.data"):
        make_env("tic_tac_toe").expert(0)


def _raising_tool(expr):
    raise KeyError("the tool is broken")


class _HangingTool:
    """Blocks until the test has seen the step return; each test gets its own events, so a
    thread released by one parametrization cannot set another's."""

    def __init__(self):
        self.release, self.returned = threading.Event(), threading.Event()

    def __call__(self, expr):
        self.release.wait(60.0)
        self.returned.set()
        return 1


@pytest.mark.parametrize("make_tool, why", [(lambda: _raising_tool, "tool raised KeyError"),
                                            (_HangingTool, "did not return within 0.2s"),
                                            (lambda: (lambda e: "12"), "returned str")])
def test_a_failing_tool_ends_the_episode_with_a_penalty(make_tool, why):
    tool = make_tool()
    env = CalculatorEnv(tool=tool, tool_timeout_s=0.2, tool_failure_penalty=-0.5)
    env.reset(0)
    res = env.step("<calc>1+1</calc>")
    if isinstance(tool, _HangingTool):
        # the tool is still blocked: the step returned on the guard, not on the tool
        assert not tool.returned.is_set()
        tool.release.set()
        assert tool.returned.wait(60.0)
    assert (res.reward, res.done, res.info["tool_error"], res.info["tool_failed"]) == \
        (-0.5, True, True, True)
    assert why in res.observation
    # the environment is usable for the next episode
    env.reset(1)
    assert env.step("<answer>1</answer>").done


def test_tool_metrics():
    from earl_megatron.envs.tool_env import tool_metrics

    rows = [(True, 1, False, False, 2), (False, 0, False, False, 1), (False, 2, True, True, 3),
            (True, 1, False, False, 2)]
    assert tool_metrics(rows) == {"accuracy": 0.5, "tool_calls": 1.0, "tool_error_rate": 0.25,
                                  "unparsable_turn_rate": 1 / 8}


# --- the JSON tool-call format (tool_format="json", envs/tool_calls.py) ---------------------

def test_json_format_episode_tool_messages_and_answer():
    from earl_megatron.envs.tool_calls import CALCULATOR_SCHEMA, parse_json_action, tool_call_text

    env = CalculatorEnv(tool_format="json")
    expr, value = make_question(7)
    assert env.reset(7) == f"What is {expr}?"
    prompt = env.system_prompt
    assert f"<tools>\n{json.dumps(CALCULATOR_SCHEMA)}\n</tools>" in prompt
    assert "<answer>391</answer>" in prompt and tool_call_text("17*23") in prompt
    assert parse_json_action(tool_call_text("17*23")) == ("call", "17*23")  # a valid example
    res = env.step("Let me check.\n" + tool_call_text(expr))
    assert (res.observation, res.reward, res.done, res.info, res.role) == \
        (str(value), 0.0, False, {"tool_calls": 1}, "tool")
    # forgiving of whitespace: around the tags, inside the JSON, around the expression
    res = env.step(' <tool_call> \n{ "arguments" : {"expression": " 1/0 "},\n"name":"calculator"}'
                   '  </tool_call> and more')
    assert (res.observation, res.reward, res.done, res.role) == \
        ("error: division by zero", 0.0, False, "tool")
    assert res.info == {"tool_error": True, "tool_calls": 2}
    res = env.step(f"<answer> {value} </answer>")
    assert (res.reward, res.done, res.info["correct"], res.role) == (1.0, True, True, "user")
    env.reset(7)
    assert env.step(f"<answer>{value + 1}</answer>").reward == 0.0


@pytest.mark.parametrize("call, why", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>',
     "not valid JSON"),
    ("<tool_call>calculator(1+1)</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator", "1+1"]</tool_call>', 'exactly "name" and "arguments"'),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}, "id": 1}'
     '</tool_call>', 'exactly "name" and "arguments"'),
    ('<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>',
     "unknown tool 'calc'"),
    ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'
     '</tool_call>', "arguments are exactly"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 2}}</tool_call>',
     "arguments are exactly"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>',
     "arguments are exactly"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1", "x": 1}}'
     '</tool_call>', "arguments are exactly"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}', "not closed"),
    ('<tool_call>{"name": "calculator" <answer>2</answer>', "not closed"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}'
     '</tool_call>', "is not allowed"),
])
def test_json_malformed_call_is_a_tool_error_never_a_crash(call, why):
    env = CalculatorEnv(tool_format="json", invalid_penalty=-0.25)
    env.reset(1)
    res = env.step(call)
    assert (res.reward, res.done, res.role) == (-0.25, True, "tool")
    assert res.info["tool_error"] and res.info["malformed_call"] and "unparsable" not in res.info
    assert res.observation.startswith("error: ") and why in res.observation


@pytest.mark.parametrize("text", ["391", "<calc>1+1</calc>", "<answer>eighty</answer>", ""])
def test_json_format_no_action_is_unparsable(text):
    env = CalculatorEnv(tool_format="json", invalid_penalty=-0.5)
    env.reset(2)
    res = env.step(text)
    assert (res.reward, res.done, res.info["unparsable"], res.role) == (-0.5, True, True, "user")


def test_json_expert_writes_the_json_format():
    from earl_megatron.envs.tool_calls import parse_json_action, tool_call_text
    from earl_megatron.rollout.trajectories import expert_trajectories

    expr, value = make_question(5)
    assert CalculatorEnv(tool_format="json", expert_tool_rate=1.0).expert(5) == \
        [tool_call_text(expr), f"<answer>{value}</answer>"]
    assert parse_json_action(tool_call_text(expr)) == ("call", expr)
    traces = expert_trajectories(lambda: CalculatorEnv(tool_format="json"), range(40))
    tool = [t for t in traces if t.meta["info"]["tool_calls"] == 1]
    assert 10 <= len(tool) <= 30 and all(t.meta["reward"] == 1.0 for t in tool)
    for t in tool:  # system (the tools), the question, the call, the tool's result, the answer
        assert [r for r, _ in t.messages] == ["system", "user", "assistant", "tool", "assistant"]
        _, value = make_question(t.meta["seed"])
        assert t.messages[3][1] == str(value)
    # the same seeds in the tags format: same choices, tags, results as user turns
    tags = expert_trajectories(lambda: CalculatorEnv(), range(40))
    assert [t.meta["reward"] for t in tags] == [t.meta["reward"] for t in traces]
    assert {t.messages[3][0] for t in tags if len(t.messages) > 3} == {"user"}


def test_tool_format_and_role_are_checked():
    from earl_megatron.envs import StepResult

    with pytest.raises(ValueError, match="tool_format='xml'.*'tags', 'json'"):
        CalculatorEnv(tool_format="xml")
    for role in ("assistant", "system", ""):
        with pytest.raises(ValueError, match="StepResult.role"):
            StepResult("obs", 0.0, False, role=role)
    assert StepResult("obs", 0.0, False).role == "user"
    env = CalculatorEnv()  # the tags format is unchanged: results are user turns
    env.reset(0)
    assert env.step("<calc>1+1</calc>").role == "user"
