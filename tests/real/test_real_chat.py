"""SmolLM2's own tokenizer and ChatML template in the agent loop (issue 23, items 3 and 4).

3-turn calculator episodes in the JSON tool-call format, driven by a scripted engine (a real
RolloutEngine whose samples are known: testing/chat_check.py), with turns that end on
<|im_end|>, turns cut by the token budget in the middle and at the end of an episode, a tool
error, a malformed call and a max_turns cut. On each, token-in/token-out holds: the trained ids
are exactly the sampled ids, everything else is the template's own tokens (tool results in tool
messages), and the decoded episode is the template's text of the whole conversation. The
expert's JSON traces tokenize to exactly the episode the agent loop builds when the engine
samples them. All but the last test need the tokenizer only; the last runs the real weights
(transformers, greedy, 2 episodes of 3 turns) and checks the same on the model's own samples.
"""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from earl_megatron.envs.base import StepResult
from earl_megatron.envs.tool_calls import CALCULATOR_SCHEMA, tool_call_text
from earl_megatron.envs.tool_env import CalculatorEnv, make_question, safe_eval
from earl_megatron.rollout.agent_loop import AgentLoopConfig, run_episodes
from earl_megatron.rollout.tokenizer import chat_format
from earl_megatron.rollout.trajectories import expert_trajectories, trajectory_tokens
from earl_megatron.testing.chat_check import Recording, ScriptedEngine, check_episode

CHATTER = " I will wait for the calculator's answer before I say anything else here."
"""Text after a complete call that runs the turn past its budget (a cut turn the env accepts)."""
BUDGET = 48
"""max_action_tokens: a call on a default question is ~36 SmolLM2 tokens, CHATTER ~16 more."""

# what the scripted policy says at each turn, by plan; "V" is the true value
PLANS = {
    "plain": ["call", "call-pieces", "<answer>V</answer>"],          # 3 turns, all stopped
    "cut-middle": ["call+chatter", "call:1/0", "  <answer>V</answer>"],  # cut, tool error, "  "
    "cut-last": ["call", "call", "<answer>V</answer>" + CHATTER * 3],  # the final turn is cut
    "malformed": ['<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>'],
    "max-turns": ["call", "call", "call", "call"],                    # stopped by max_turns=3
}
SEEDS = dict(zip(PLANS, range(5)))


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def scripted_policy(plans_by_expr):
    def reply(text):
        expr = re.search(r"What is (.*?)\?<\|im_end\|>", text).group(1)
        plan = plans_by_expr[expr]
        say = plan[text.count("<|im_start|>assistant\n") - 1]  # one is the generation prompt
        value = str(safe_eval(expr))
        if say == "call":
            return tool_call_text(expr)
        if say == "call-pieces":  # a tokenization the tokenizer would not pick: kept as sampled
            call = tool_call_text(expr)
            return [call[:7], call[7:20], call[20:]]
        if say == "call+chatter":
            return tool_call_text(expr) + CHATTER
        if say.startswith("call:"):
            return tool_call_text(say[len("call:"):])
        return say.replace("V", value)
    return reply


@pytest.mark.parametrize("system", ["json", "template default"])
def test_token_in_token_out_on_tool_episodes(tok, system):
    kwargs = {} if system == "json" else {"system_prompt": ""}
    envs = [CalculatorEnv(tool_format="json", **kwargs) for _ in PLANS]
    by_expr = {make_question(SEEDS[name])[0]: plan for name, plan in PLANS.items()}
    assert len(by_expr) == len(PLANS)
    engine = ScriptedEngine(tok, scripted_policy(by_expr))
    cfg = AgentLoopConfig(max_turns=3, max_context_tokens=4096, max_action_tokens=BUDGET,
                          temperature=0.0)
    episodes = dict(zip(PLANS, run_episodes(engine, envs, list(SEEDS.values()), tok, cfg)))
    fmt = chat_format(tok)
    assert (fmt.end_of_turn, fmt.turn_suffix, fmt.stop_token_ids) == ("<|im_end|>", "\n", (2,))
    texts = {}
    for name, ep in episodes.items():
        messages = check_episode(ep, tok, envs[0].system_prompt, engine)
        texts[name] = tok.decode(list(ep.token_ids))
        if system == "json":
            assert f"<tools>\n{json.dumps(CALCULATOR_SCHEMA)}\n</tools>" in messages[0]["content"]
        else:  # no system message given: the template's own default system prompt is there
            assert texts[name].startswith("<|im_start|>system\nYou are a helpful AI assistant "
                                          "named SmolLM")
    outcome = {n: (e.turns, e.finish_reason, e.reward, e.observation_roles)
               for n, e in episodes.items()}
    assert outcome == {
        "plain": (3, "done", 1.0, ("user", "tool", "tool", "user")),
        "cut-middle": (3, "done", 1.0, ("user", "tool", "tool", "user")),
        "cut-last": (3, "done", 1.0, ("user", "tool", "tool", "user")),
        "malformed": (1, "done", -1.0, ("user", "tool")),
        "max-turns": (3, "max_turns", 0.0, ("user", "tool", "tool", "tool")),
    }
    assert episodes["malformed"].info["tool_error"] and episodes["malformed"].info[
        "malformed_call"]
    assert episodes["cut-middle"].info["tool_error"]  # 1/0: refused, the episode went on
    assert "<|im_start|>tool\nerror: division by zero<|im_end|>" in texts["cut-middle"]
    # what is trained: each sampled turn with its <|im_end|> when sampled; the newline after it,
    # the tool results and the cut turn's closing <|im_end|> are the template's
    ep = episodes["cut-middle"]
    trained = tok.decode([t for t, m in zip(ep.token_ids, ep.loss_mask) if m])
    expr, value = make_question(SEEDS["cut-middle"])
    sampled0 = tok.decode(list(engine._encode(tool_call_text(expr) + CHATTER))[:BUDGET])
    assert trained == (sampled0 + tool_call_text("1/0") + "<|im_end|>" +
                       f"  <answer>{value}</answer><|im_end|>")
    assert texts["cut-middle"].count(sampled0 + "<|im_end|>\n<|im_start|>tool\n") == 1
    # a re-tokenization of the same text gives other ids at the "  <answer>" boundary (the
    # newline merges with a space), which is why the loop never re-tokenizes
    assert tok(texts["cut-middle"], add_special_tokens=False)["input_ids"] != list(ep.token_ids)
    # the cut final turn: no <|im_end|> sampled, none appended after it
    last = episodes["cut-last"]
    assert last.token_ids[-1] != 2 and last.loss_mask[-BUDGET - 1:] == (0,) + (1,) * BUDGET


def test_expert_json_traces_are_the_agent_loops_episodes(tok):
    make = lambda: CalculatorEnv(tool_format="json", expert_tool_rate=0.5)  # noqa: E731
    seeds = list(range(6))
    traces = expert_trajectories(make, seeds)
    assert {t.messages[3][0] for t in traces if len(t.messages) > 3} == {"tool"}
    assert any(len(t.messages) == 3 for t in traces) and any(len(t.messages) == 5 for t in traces)
    assert all(t.meta["reward"] == 1.0 for t in traces if len(t.messages) == 5)
    actions = {make_question(s)[0]: make().expert(s) for s in seeds}

    def replay(text):
        expr = re.search(r"What is (.*?)\?<\|im_end\|>", text).group(1)
        return actions[expr][text.count("<|im_start|>assistant\n") - 1]

    engine = ScriptedEngine(tok, replay)
    cfg = AgentLoopConfig(max_turns=4, max_context_tokens=4096, max_action_tokens=BUDGET)
    episodes = run_episodes(engine, [make() for _ in seeds], seeds, tok, cfg)
    for trace, ep in zip(traces, episodes):
        ids, mask = trajectory_tokens(trace, tok)
        assert (ids, mask) == (list(ep.token_ids), list(ep.loss_mask))
        whole = tok.apply_chat_template([{"role": r, "content": c} for r, c in trace.messages],
                                        tokenize=False)
        assert tok.decode(ids) + "\n" == whole
        assert ep.reward == trace.meta["reward"]
        check_episode(ep, tok, make().system_prompt, engine)


class _Reminding(CalculatorEnv):
    """The JSON calculator, except that a reply with neither a call nor an answer (the base
    model's usual reply) gets a user-turn reminder, up to twice, so the real model samples
    three turns after template, tool and user tokens."""

    def _reset(self, seed):
        self.left = 2
        return super()._reset(seed)

    def _step(self, action):
        res = super()._step(action)
        if res.done and res.info.get("unparsable") and self.left > 0:
            self.left -= 1
            return StepResult("Call the calculator with a <tool_call>.", 0.0, False,
                              {"reminded": True})
        return res


def test_real_weights_samples_are_kept_token_for_token(tok, smollm2_dir):
    """The real model's own greedy samples (HF reference engine, 2 episodes of 3 turns): the
    same invariant, on ids nobody scripted."""
    import torch
    from transformers import AutoModelForCausalLM

    from earl_megatron.testing.hf_engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    engine = Recording(HFEngine(model, pad_token_id=tok.pad_token_id))
    envs = [_Reminding(tool_format="json", num_operands=2) for _ in range(2)]
    cfg = AgentLoopConfig(max_turns=3, max_context_tokens=1024, max_action_tokens=24,
                          temperature=0.0)
    episodes = run_episodes(engine, envs, [11, 12], tok, cfg)
    assert sum(e.turns for e in episodes) >= 4  # multi-turn contexts were built and sampled
    for ep in episodes:
        check_episode(ep, tok, envs[0].system_prompt, engine)
