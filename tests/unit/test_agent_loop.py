"""Agent loop and HF reference engine on a tiny random Llama (vocab 128), char tokenizer.

Some tests edit the random model's weights into a *biased* policy: residual dim 0 carries a
constant 50 through every layer (embeddings set it, attention/MLP outputs leave it alone), and the
LM head reads that dim, so chosen tokens get logits ~40 above the rest whatever the context. With
'3' and <|end|> favoured (p ~ 0.8 / 0.2) the model plays column 3 and ends turns at random; with
'3' alone it never ends a turn. It is still a real model run by the real engine.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from earl_megatron.envs import make_env
from earl_megatron.rollout.agent_loop import (AgentLoopConfig, Episode, RolloutAbandoned,
                                              run_episodes, summarize)
from earl_megatron.rollout.engine import SamplingParams
from earl_megatron.testing.hf_engine import HFEngine
from earl_megatron.rollout.tokenizer import (chat_format, char_tokenizer, render_next_turn,
                                             render_prompt)

TOK = char_tokenizer()
FMT = chat_format(TOK)
END = FMT.stop_token_ids[0]
THREE = TOK.convert_tokens_to_ids("3")


def tiny_llama(seed=0, favour=None):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-6,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    if favour:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 50.0
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight[0, :] = 0.0
                layer.mlp.down_proj.weight[0, :] = 0.0
            model.lm_head.weight[:, 0] = 0.0
            for tok, weight in favour.items():
                model.lm_head.weight[tok, 0] = weight
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the tiny model's ops are far too small to share out; on a loaded 2-core machine torch's
    # default intra-op threads made each decode step ~50x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def biased():
    return tiny_llama(1, favour={THREE: 5.0, END: 4.8})


@pytest.fixture(scope="module")
def always_three():
    return tiny_llama(2, favour={THREE: 5.0})


def recomputed_logprobs(model, episode, temperature=1.0):
    ids = torch.tensor([episode.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)
    return [logp[t - 1, episode.token_ids[t]].item() if m else 0.0
            for t, m in enumerate(episode.loss_mask)]


def rebuild(episode, env, max_action_tokens):
    """The context and mask the loop should have built, from the env replay and the actions."""
    obs = env.reset(episode.seed)
    assert obs == episode.observations[0]
    ids = render_prompt(TOK, env.system_prompt, obs)
    mask = [0] * len(ids)
    for t, action in enumerate(episode.actions):
        sampled = TOK(action, add_special_tokens=False)["input_ids"]
        stopped = len(sampled) < max_action_tokens
        sampled += [END] if stopped else []
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        res = env.step(action)
        assert res.observation == episode.observations[t + 1]
        if t + 1 < len(episode.actions):
            nxt = render_next_turn(TOK, FMT, res.observation, stopped)
            ids, mask = ids + nxt, mask + [0] * len(nxt)
    return ids, mask


def test_mixed_batch_mask_logprobs_and_replay(biased):
    cfg = AgentLoopConfig(max_turns=8, max_context_tokens=1024, max_action_tokens=3, seed=4)
    envs = [make_env("connect_four") for _ in range(6)] + [make_env("calculator")]
    episodes = run_episodes(HFEngine(biased), envs, list(range(7)), TOK, cfg)
    assert [e.env for e in episodes] == ["connect_four"] * 6 + ["calculator"]
    assert max(e.turns for e in episodes) >= 3  # multi-turn contexts were built
    assert any(e.info.get("outcome") == "win" for e in episodes)  # column 3 four times
    assert any(a.endswith("3") for e in episodes for a in e.actions)  # a turn hit the budget
    worst = 0.0
    for ep, env in zip(episodes, [make_env(e.env) for e in episodes]):
        ids, mask = rebuild(ep, env, cfg.max_action_tokens)
        assert list(ep.token_ids) == ids and list(ep.loss_mask) == mask
        assert [lp != 0.0 for lp in ep.logprobs] == [m == 1 for m in ep.loss_mask]
        worst = max(worst, max(abs(a - b) for a, b in
                               zip(recomputed_logprobs(biased, ep), ep.logprobs)))
        assert ep.finish_reason == "done" and ep.turns == len(ep.actions)
    assert worst < 1e-4
    # the calculator never sees a tag from this model: unparsable with the default penalty
    calc = episodes[-1]
    assert (calc.reward, calc.info["unparsable"], calc.turns) == (-1.0, True, 1)


def test_progress_counts_the_episodes_ended_after_every_turn(biased, always_three):
    """An evaluation's live view (trainer/evaluation.py) reads these counts: (episodes ended,
    episodes) before the first turn and after each, here episodes of different lengths."""
    cfg = AgentLoopConfig(max_turns=8, max_context_tokens=1024, max_action_tokens=3, seed=4)
    envs = [make_env("connect_four") for _ in range(6)] + [make_env("calculator")]
    seen = []
    episodes = run_episodes(HFEngine(biased), envs, list(range(7)), TOK, cfg,
                            progress=lambda done, total: seen.append((done, total)))
    turns = max(e.turns for e in episodes)
    assert len({e.turns for e in episodes}) > 1          # they do end at different turns
    assert seen == [(sum(e.turns <= t for e in episodes), 7) for t in range(turns + 1)]
    seen.clear()   # both cut by max_turns after their second turn
    run_episodes(HFEngine(always_three), [make_env("connect_four") for _ in range(2)], [0, 1],
                 TOK, AgentLoopConfig(max_turns=2, max_action_tokens=3, temperature=0.0),
                 progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 2), (0, 2), (2, 2)]
    # an episode with no room for a turn has ended before the first one
    env = make_env("connect_four")
    prompt = len(render_prompt(TOK, env.system_prompt, env.reset(0)))
    seen.clear()
    run_episodes(HFEngine(always_three), [env], [0], TOK,
                 AgentLoopConfig(max_context_tokens=prompt + 2, max_action_tokens=3),
                 progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)]


def test_garbage_model_is_penalised_without_crashing():
    model = tiny_llama(3)
    envs = [make_env("connect_four", invalid_penalty=-0.5) for _ in range(8)]
    cfg = AgentLoopConfig(max_action_tokens=4, temperature=1.0, seed=0)
    episodes = run_episodes(HFEngine(model), envs, list(range(8)), TOK, cfg)
    bad = [e for e in episodes if e.info.get("unparsable") or e.info.get("illegal")]
    assert len(bad) >= 6
    assert all(e.reward == -0.5 and e.finish_reason == "done" for e in bad)
    metrics = summarize(episodes)
    assert metrics.unparsable_rate + metrics.illegal_rate == len(bad) / 8
    worst = max(abs(a - b) for e in episodes
                for a, b in zip(recomputed_logprobs(model, e), e.logprobs))
    assert worst < 1e-4


def test_max_turns_reported(always_three):
    cfg = AgentLoopConfig(max_turns=2, max_action_tokens=3, temperature=0.0)
    ep, = run_episodes(HFEngine(always_three), [make_env("connect_four")], [0], TOK, cfg)
    assert (ep.finish_reason, ep.turns, ep.actions, ep.reward) == ("max_turns", 2, ("333",) * 2,
                                                                  0.0)
    assert "outcome" not in ep.info and ep.num_policy_tokens == 6
    ids, mask = rebuild(ep, make_env("connect_four"), 3)
    assert list(ep.token_ids) == ids and list(ep.loss_mask) == mask
    assert ids[ep.prompt_length + 3] == END  # the unfinished turn closed by a template token


def test_should_stop_abandons_before_a_turn(always_three):
    # called once before every turn; True on the 2nd call: one turn played, then abandoned
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) == 2

    cfg = AgentLoopConfig(max_turns=4, max_action_tokens=3, temperature=0.0)
    with pytest.raises(RolloutAbandoned, match="before turn 1"):
        run_episodes(HFEngine(always_three), [make_env("connect_four")], [0], TOK, cfg,
                     should_stop=should_stop)
    assert len(calls) == 2
    ep, = run_episodes(HFEngine(always_three), [make_env("connect_four")], [0], TOK, cfg,
                       should_stop=lambda: False)
    assert ep.turns == 4  # never told: plays to the end as without the hook


def test_max_context_reported(always_three):
    env = make_env("connect_four")
    prompt = len(render_prompt(TOK, env.system_prompt, env.reset(0)))
    engine = HFEngine(always_three)
    # room for the prompt and one turn, not for the next observation plus another turn
    cfg = AgentLoopConfig(max_context_tokens=prompt + 3 + 40, max_action_tokens=3,
                          temperature=0.0)
    ep, = run_episodes(engine, [env], [0], TOK, cfg)
    assert (ep.finish_reason, ep.turns, len(ep.token_ids)) == ("max_context", 1, prompt + 3)
    # no room even for the first turn: reported with zero turns, nothing generated
    cfg = AgentLoopConfig(max_context_tokens=prompt + 2, max_action_tokens=3)
    ep, = run_episodes(engine, [make_env("connect_four")], [0], TOK, cfg)
    assert (ep.finish_reason, ep.turns, len(ep.token_ids), ep.num_policy_tokens) == \
        ("max_context", 0, prompt, 0)


def test_summarize_values():
    def ep(reward, finish, info, n):
        return Episode("connect_four", 0, (1,) * n, (0,) * (n - 2) + (1, 1), (0.0,) * n, reward,
                       2, finish, n - 2, ("3", "4"), ("a", "b", "c"), info)

    m = summarize([ep(1.0, "done", {"outcome": "win"}, 10),
                   ep(-1.0, "done", {"outcome": "loss"}, 20),
                   ep(-1.0, "done", {"illegal": True}, 30),
                   ep(0.0, "max_turns", {}, 40)])
    assert (m.episodes, m.mean_reward, m.win_rate, m.loss_rate, m.draw_rate) == \
        (4, -0.25, 0.25, 0.25, 0.0)
    assert (m.illegal_rate, m.unparsable_rate, m.mean_context_tokens, m.max_context_tokens) == \
        (0.25, 0.0, 25.0, 40)
    assert (m.policy_tokens, m.finish_reasons) == (8, {"done": 3, "max_turns": 1})


def test_config_and_input_errors(always_three):
    with pytest.raises(ValueError, match="leaves no room"):
        AgentLoopConfig(max_context_tokens=8, max_action_tokens=8)
    env = make_env("connect_four")
    with pytest.raises(ValueError, match="appears twice"):
        run_episodes(HFEngine(always_three), [env, env], [0, 1], TOK)
    with pytest.raises(ValueError, match="one seed per environment"):
        run_episodes(HFEngine(always_three), [env], [0, 1], TOK)


def test_hf_engine_greedy_equals_no_cache_decode():
    model = tiny_llama(5)
    engine = HFEngine(model)
    prompts = [[2, 5, 40, 41], [2, 5, 40, 41, 42, 43, 44, 45, 46, 47, 48], [2]]
    gens = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for prompt, gen in zip(prompts, gens):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(12):  # recompute everything each step, one row at a time, no padding
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert list(gen.token_ids) == ids[len(prompt):] and gen.finish_reason == "length"


def test_hf_engine_sampling_contract():
    model = tiny_llama(6)
    engine = HFEngine(model, seed=0)
    prompts = [[2, 5, 40], [2, 5, 40, 41, 42, 43]]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10, seed=11)
    first, again = engine.generate(prompts, params), engine.generate(prompts, params)
    assert first == again  # seeded per call
    for prompt, gen in zip(prompts, first):
        ep = Episode("x", 0, tuple(prompt) + gen.token_ids,
                     (0,) * len(prompt) + (1,) * len(gen.token_ids),
                     (0.0,) * len(prompt) + gen.logprobs, 0.0, 1, "done", len(prompt), (), ())
        ref = recomputed_logprobs(model, ep, temperature=0.7)
        assert max(abs(a - b) for a, b in zip(ref, ep.logprobs)) < 1e-4
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    tiny_p = engine.generate(prompts, SamplingParams(temperature=1.0, top_p=1e-6,
                                                     max_new_tokens=10, seed=3))
    assert [g.token_ids for g in greedy] == [g.token_ids for g in tiny_p]
    stop = greedy[0].token_ids[2]
    cut = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=10,
                                                      stop_token_ids=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.token_ids[-1] == stop
    assert cut.token_ids == greedy[0].token_ids[:greedy[0].token_ids.index(stop) + 1]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[2], []], params)
    engine.release_memory()
    assert not engine.health().healthy
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(prompts, params)
    engine.resume_memory()
    engine.update_weights(tiny_llama(7))
    assert engine.generate(prompts, params) != first


def _scripted_calculator(tok, plans, question, count_turns):
    """A ScriptedEngine playing ``plans[expr]`` (one reply per turn) on calculator episodes."""
    import re

    from earl_megatron.testing.chat_check import ScriptedEngine

    def reply(text):
        expr = re.search(question, text).group(1)
        return plans[expr][count_turns(text) - 1]

    return ScriptedEngine(tok, reply)


@pytest.mark.parametrize("tool_format", ["json", "tags"])
def test_tool_turns_are_token_in_token_out(tool_format):
    """The invariant of tests/real/test_real_chat.py (SmolLM2's ChatML) with the project's own
    templates: trained ids are the sampled ids, the rest the template's (tool results in the
    role the environment names: "tool" in the JSON format, "user" in the tags format), and the
    decoded episode is the template over the whole conversation; cut turns mid-episode and last."""
    from earl_megatron.envs.tool_calls import tool_call_text
    from earl_megatron.envs.tool_env import CalculatorEnv, make_question
    from earl_megatron.rollout.tokenizer import tool_tokenizer
    from earl_megatron.testing.chat_check import check_episode

    if tool_format == "json":
        tok, budget, call, question = TOK, 120, tool_call_text, r"What is (.*?)\?<\|end\|>"
    else:
        tok, budget, question = tool_tokenizer(), 16, r"compute (.*?)<\|end\|>"
        call = lambda e: f"<calc>{e}</calc>"  # noqa: E731
    long = " please wait while the calculator works" * 4
    exprs = [make_question(s)[0] for s in range(3)]
    value = [str(make_question(s)[1]) for s in range(3)]
    plans = {exprs[0]: [call(exprs[0]), call(exprs[0]), f"<answer>{value[0]}</answer>"],
             exprs[1]: [call(exprs[1]) + long, f"<answer>{value[1]}</answer>"],
             exprs[2]: [call(exprs[2]), f"<answer>{value[2]}</answer>" + long]}
    engine = _scripted_calculator(tok, plans, question,
                                  lambda text: text.count("<|assistant|>"))
    envs = [CalculatorEnv(tool_format=tool_format) for _ in range(3)]
    cfg = AgentLoopConfig(max_turns=4, max_context_tokens=4096, max_action_tokens=budget)
    episodes = run_episodes(engine, envs, [0, 1, 2], tok, cfg)
    role = "tool" if tool_format == "json" else "user"
    assert [(e.turns, e.reward, e.observation_roles[1]) for e in episodes] == \
        [(3, 1.0, role), (2, 1.0, role), (2, 1.0, role)]
    for ep in episodes:
        check_episode(ep, tok, envs[0].system_prompt, engine)
    cut_mid, cut_last = episodes[1], episodes[2]
    assert cut_mid.loss_mask[cut_mid.prompt_length + budget] == 0  # the closing <|end|>
    assert cut_mid.token_ids[cut_mid.prompt_length + budget] == END
    assert cut_last.token_ids[-1] != END and cut_last.loss_mask[-budget:] == (1,) * budget
    if tool_format == "json":
        assert f"<|tool|>{value[0]}<|end|><|assistant|>" in TOK.decode(list(episodes[0].token_ids))


@pytest.mark.parametrize("template, why", [
    ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
     "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
     "{% if add_generation_prompt %}<|assistant|>{% endif %}", "refuses a 'tool' message"),
    ("{% for m in messages %}{% if m['role'] != 'tool' %}<|{{ m['role'] }}|>{{ m['content'] }}"
     "<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
     "does not render a 'tool' message's content"),
])
def test_a_template_without_a_tool_role_is_a_clear_error(template, why):
    from earl_megatron.envs.tool_calls import tool_call_text
    from earl_megatron.envs.tool_env import CalculatorEnv, make_question

    tok = char_tokenizer()
    tok.chat_template = template
    expr = make_question(0)[0]
    engine = _scripted_calculator(tok, {expr: [tool_call_text(expr)]}, r"What is (.*?)\?<\|end",
                                  lambda text: text.count("<|assistant|>"))
    with pytest.raises(ValueError, match=why + ".*tool_format='tags'"):
        run_episodes(engine, [CalculatorEnv(tool_format="json")], [0], tok,
                     AgentLoopConfig(max_context_tokens=4096, max_action_tokens=120))
