"""The agent endpoint's token-in/token-out core (earl_megatron/agents/): tool-call parsers,
OpenAI messages to template text, and one episode's rows, with the char tokenizers, a BPE
tokenizer with a Qwen2.5-style native-tools template built here, and SmolLM2's own tokenizer
when it is cached."""

import json
import pathlib
import types

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from earl_megatron.agents.chat import ChatRenderer, ChatRequestError, normalize
from earl_megatron.agents.tool_parsers import (HermesParser, Llama3JsonParser, Reply, ToolCall,
                                               parser_for)
from earl_megatron.agents.trajectory import EpisodeTokens
from earl_megatron.envs.tool_calls import (CALCULATOR_SCHEMA, CALCULATOR_TASK, json_system_prompt,
                                           tool_call_text)
from earl_megatron.rollout.tokenizer import char_tokenizer, tool_tokenizer

SMOLLM2 = pathlib.Path("~/.cache/earl-models/SmolLM2-135M-Instruct").expanduser()
# a Qwen2.5-style ChatML template with a tools section, written here (same text as Qwen's)
QWENISH = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML "
    "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{% if m.content %}\n{{ m.content }}"
    "{% endif %}{% for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
).replace("%}\n", "%}{{ '\\n' }}")  # HF templates trim the newline after a block tag


def _qwenish():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([json_system_prompt(), "What is 17*23? Let me check. 391"] * 20,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = QWENISH
    return fast


TOKENIZERS = {"char": char_tokenizer, "qwenish": _qwenish,
              "smollm2": lambda: AutoTokenizer.from_pretrained(SMOLLM2)}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def renderer(request):
    if request.param == "smollm2" and not SMOLLM2.is_dir():
        pytest.skip(f"SmolLM2's tokenizer is not cached at {SMOLLM2}")
    return ChatRenderer(TOKENIZERS[request.param]())


def _assistant(reply: Reply, ids: bool = True) -> dict:
    calls = [dict({"id": c.id} if ids else {}, type="function",
                  function={"name": c.name, "arguments": c.arguments}) for c in reply.tool_calls]
    return dict({"role": "assistant", "content": reply.content}, **{"tool_calls": calls} if calls
                else {})


def _sample(ep: EpisodeTokens, prompt, text: str, cut, sampled: list, stop_text_cut: int = 0):
    """Sample ``text``: closed by the end-of-turn token, cut (``cut`` True: no stop token) or
    ended by EOS (``cut == "eos"``: a stop token that is not the end-of-turn)."""
    r = ep.renderer
    end = {False: [r.fmt.stop_token_ids[0]], True: [], "eos": [r.tokenizer.eos_token_id]}[cut]
    ids = r.encode(text) + end
    lps = [-0.25 - 0.01 * k for k in range(len(ids))]
    sampled.append((prompt.row, ids, lps))
    return ep.complete(prompt, ids, lps, "length" if cut is True else "stop", stop_text_cut)


def check_row(renderer: ChatRenderer, row, sampled: list):
    """The invariants of agents/trajectory.py's docstring on one row."""
    tok, fmt = renderer.tokenizer, renderer.fmt
    n = len(row.token_ids)
    assert len(row.loss_mask) == len(row.logprobs) == n
    segments, at = [], 0  # maximal mask-1 runs: exactly the sampled ids, with their logprobs
    while at < n:
        end = at
        while end < n and row.loss_mask[end] == row.loss_mask[at]:
            end += 1
        if row.loss_mask[at] == 1:
            segments.append((list(row.token_ids[at:end]), list(row.logprobs[at:end])))
        else:
            assert set(row.logprobs[at:end]) == {0.0}
        at = end
    assert segments == [(ids, lps) for _, ids, lps in sampled][-len(segments):]
    assert len(segments) == row.turns
    full = renderer.messages_text(list(row.messages), list(row.tools), False)
    cut = row.token_ids[-1] != fmt.stop_token_ids[0]
    tail = (fmt.end_of_turn if cut else "") + fmt.turn_suffix
    assert full.endswith(tail) and tok.decode(list(row.token_ids)) == full[:len(full) - len(tail)]


SYSTEM = [{"role": "system", "content": CALCULATOR_TASK},
          {"role": "user", "content": "What is 17*23?"}]
CALL = "Let me check.\n" + tool_call_text("17*23")
TWO_CALLS = tool_call_text("17*23") + "\n" + tool_call_text("391+1")


@pytest.mark.parametrize("send_back", ["ids", "no ids"])
def test_tool_conversation_extends_one_row(renderer, send_back):
    ep, sampled = EpisodeTokens(renderer), []
    messages, tools = list(SYSTEM), [CALCULATOR_SCHEMA]
    script = [(CALL, False), (TWO_CALLS, True), ("  391", False), ("392", "eos"),
              ("<answer>391</answer>", True)]
    for text, cut in script:
        prompt = ep.prompt(messages, tools)
        assert (prompt.forked, prompt.reason, prompt.row) == (False, "", 0)
        reply = _sample(ep, prompt, text, cut, sampled)
        messages.append(_assistant(reply, ids=send_back == "ids"))
        if reply.tool_calls:  # every call answered by a tool message
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "391"}
                         for c in reply.tool_calls]
        else:  # a content-only reply, sent back as content only
            messages.append({"role": "user", "content": [{"type": "text", "text": "again"}]})
    assert ep.forks == 0 and ep.calls == 5
    (row,) = ep.rows()
    assert (row.turns, row.tool_calls, row.malformed) == (5, 3, 0)
    assert row.finish_reasons == ("stop", "length", "stop", "stop", "length")
    check_row(renderer, row, sampled)
    # the prompt of the last turn was the row up to it: the engine saw exactly the row's tokens
    assert list(prompt.ids) == list(row.token_ids[:len(prompt.ids)])


def test_replies_parse_with_ids(renderer):
    ep, sampled = EpisodeTokens(renderer, id_tag="ep7_"), []
    reply = _sample(ep, ep.prompt(SYSTEM, [CALCULATOR_SCHEMA]), TWO_CALLS, False, sampled)
    assert reply == Reply(None, (ToolCall("call_ep7_0_0", "calculator", '{"expression": "17*23"}'),
                                 ToolCall("call_ep7_0_1", "calculator", '{"expression": "391+1"}')),
                          0)


def _fork_reason(renderer, edit) -> tuple:
    ep, sampled, tools, messages = EpisodeTokens(renderer), [], [CALCULATOR_SCHEMA], list(SYSTEM)
    reply = _sample(ep, ep.prompt(messages, tools), CALL, False, sampled)
    messages += [_assistant(reply), {"role": "tool", "tool_call_id": "call_0_0", "content": "391"}]
    reply = _sample(ep, ep.prompt(messages, tools), "<answer>391</answer>", True, sampled)
    messages.append(_assistant(reply))
    messages, tools = edit(messages, tools)
    prompt = ep.prompt(messages + [{"role": "user", "content": "and 2*3?"}], tools)
    _sample(ep, prompt, "<answer>6</answer>", False, sampled)
    for k, row in enumerate(ep.rows()):
        check_row(renderer, row, [s for s in sampled if s[0] == k])
    return prompt.forked, prompt.reason, ep.forks, len(ep.rows())


@pytest.mark.parametrize("edit,reason", [
    (lambda m, t: (m, t), ""),
    (lambda m, t: (m[:3] + [{**m[3], "content": "392"}] + m[4:], t), "history edited at message 3"),
    (lambda m, t: (m[:2] + m[4:], t), "history edited at message 2"),
    (lambda m, t: (m, t + [{"type": "function", "function": {"name": "x"}}]), "tools changed"),
    (lambda m, t: (m[:2] + [{**m[2], "content": "I will check."}] + m[3:], t),
     "history edited at message 2"),
])
def test_forks_name_the_failed_check(renderer, edit, reason):
    forked, why, forks, rows = _fork_reason(renderer, edit)
    assert (forked, why, forks, rows) == (bool(reason), reason, int(bool(reason)),
                                          1 + bool(reason))


def test_dropped_turn_and_retry():
    renderer = ChatRenderer(char_tokenizer())
    ep, sampled = EpisodeTokens(renderer), []
    first = ep.prompt(SYSTEM[1:])
    assert ep.prompt(SYSTEM[1:]).row == first.row  # a retry reuses its pending row
    reply = _sample(ep, first, "a", False, sampled)
    _sample(ep, ep.prompt(SYSTEM[1:] + [_assistant(reply)] + [{"role": "user", "content": "b"}]),
            "c", False, sampled)
    prompt = ep.prompt(SYSTEM[1:] + [_assistant(reply)])  # the last two turns dropped
    assert (prompt.forked, prompt.reason) == (True, "turn dropped: the request has 2 messages, "
                                                    "the row 4")
    # two answers to the same prompt (concurrent requests): the second branches
    twice = ep.prompt(SYSTEM[1:] + [_assistant(reply)] + [{"role": "user", "content": "d"}])
    _sample(ep, twice, "e", False, sampled)
    _sample(ep, twice, "f", True, sampled)
    rows = ep.rows()
    assert [r.forked_from_reason[:28] for r in rows] == [
        "", "history edited at message 2", "row 2 got another completion"]
    assert rows[-1].token_ids[:len(twice.ids)] == twice.ids and rows[-1].turns == 1
    assert ep.forks == 3
    check_row(renderer, rows[0], [s for s in sampled if s[0] == 0])
    check_row(renderer, rows[1], sampled[-2:-1])
    check_row(renderer, rows[2], sampled[-1:])


def test_tags_tokenizer_single_token_tags():
    renderer = ChatRenderer(tool_tokenizer())
    ep, sampled = EpisodeTokens(renderer), []
    messages = [{"role": "system", "content": "calculator: <calc>expr</calc>."},
                {"role": "user", "content": "compute 2+3"}]
    for text in ["<calc>2+3</calc>", "<answer>5</answer>"]:
        reply = _sample(ep, ep.prompt(messages), text, False, sampled)
        assert reply == Reply(text, (), 0)
        messages += [_assistant(reply), {"role": "user", "content": "<result>5</result>"}]
    (row,) = ep.rows()
    check_row(renderer, row, sampled)
    assert row.token_ids.count(renderer.tokenizer.convert_tokens_to_ids("<calc>")) == 2


def test_calculator_system_turn_is_json_system_prompt(renderer):
    """An agent program sending CALCULATOR_TASK with tools=[CALCULATOR_SCHEMA] shows the model
    the system turn the calculator's traces were written with, native tools section or not."""
    assert json_system_prompt() == CALCULATOR_TASK + HermesParser().tools_block([CALCULATOR_SCHEMA])
    agent = renderer.messages_text(SYSTEM, [CALCULATOR_SCHEMA], True)
    env = renderer.messages_text([{"role": "system", "content": json_system_prompt()}, SYSTEM[1]],
                                 None, True)
    assert agent == env and json_system_prompt() in agent
    assert renderer.native_tools == (renderer.tokenizer.chat_template == QWENISH)


def test_assistant_tool_calls_render_as_the_model_writes_them(renderer):
    msgs = SYSTEM + [{"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator",
                                          "arguments": '{"expression":"17*23"}'}}]}]
    text = renderer.messages_text(msgs, [CALCULATOR_SCHEMA], False)
    assert CALL in text  # native (arguments as an object) and render_calls give the same text


def test_hermes_parser():
    p, call = HermesParser(), ToolCall("call_x_0", "calculator", '{"expression": "17*23"}')
    assert p.parse(tool_call_text("17*23"), "x") == Reply(None, (call,), 0)
    assert [p.parse(t, "x") for t in ("no call here ", "")] == [Reply("no call here", (), 0),
                                                                  Reply("", (), 0)]
    bad = ['<tool_call>{"name": "calculator"}</tool_call>', "<tool_call>not json</tool_call>",
           '<tool_call>{"name": "c", "arguments": "x"}</tool_call>', "<tool_call>[1]</tool_call>",
           '<tool_call>{"name": "c", "arguments": {}}']
    for text in bad:
        assert p.parse(text, "x") == Reply(text, (), 1)
    mixed = p.parse("hi " + bad[1] + tool_call_text("17*23") + tool_call_text("1"), "x")
    assert mixed.content == "hi " + bad[1] and mixed.malformed == 1
    assert [c.id for c in mixed.tool_calls] == ["call_x_0", "call_x_1"]
    assert p.parse("<tool_call>" + "[" * 100000 + "</tool_call>", "x").malformed == 1


def test_llama3_json_parser():
    p = Llama3JsonParser()
    call = ToolCall("call_y_0", "calculator", '{"expression": "17*23"}')
    text = '{"name": "calculator", "parameters": {"expression": "17*23"}}'
    assert p.parse(text, "y") == p.parse("<|python_tag|>" + text, "y") == Reply(None, (call,), 0)
    assert p.parse("The answer is 391.", "y") == Reply("The answer is 391.", (), 0)
    assert p.parse(text + "; " + text, "y").tool_calls[1].id == "call_y_1"
    for bad in ['{"name": "calculator"}', "{not json", text + " trailing", "<|python_tag|>[]"]:
        assert p.parse(bad, "y") == Reply(bad, (), 1)


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
@pytest.mark.parametrize("content", [None, "Let me check."])
def test_render_calls_round_trips(parser, content):
    calls = [("calculator", '{"expression": "17*23"}'), ("search", '{"q": "é", "n": 3}')]
    reply = parser.parse(parser.render_calls(content, calls), "z")
    assert reply.content == content and reply.malformed == 0
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == \
        [(n, json.loads(a)) for n, a in calls]
    assert parser.parse(parser.render_calls("plain", []), "z") == Reply("plain", (), 0)


def test_parser_for_picks_by_template():
    llama = types.SimpleNamespace(chat_template="{{ '<|start_header_id|>' }}...<|eot_id|>")
    assert parser_for(llama).name == "llama3_json"
    for template in [None, QWENISH, "{{ unknown }}", {"default": "<|im_start|>", "tool_use": ""}]:
        assert parser_for(types.SimpleNamespace(chat_template=template)).name == "hermes"
    assert parser_for(char_tokenizer()).name == "hermes"


@pytest.mark.parametrize("messages,field", [
    ("hi", "messages must be a non-empty list"),
    ([], "messages must be a non-empty list"),
    (["hi"], "messages[0] is a str"),
    ([{"role": "robot", "content": "x"}], "messages[0].role is 'robot'"),
    ([{"role": "user"}], "messages[0].content is missing"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": 3}], "messages[0].content is a int"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "c",
                                                                           "arguments": "{x"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}],
     "messages[0].tool_calls[0] needs"),
])
def test_bad_requests_name_the_field(messages, field):
    with pytest.raises(ChatRequestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        normalize(messages)


def test_normalize_roles_and_idempotence():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "i", "type": "function",
                             "function": {"name": "c", "arguments": {"x": 1}}}]},
            {"role": "tool", "tool_call_id": "i", "content": "1", "extra": 3}]
    out = normalize(msgs)
    assert out == [{"role": "system", "content": "a\nb"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"id": "i", "type": "function",
                        "function": {"name": "c", "arguments": '{"x": 1}'}}]},
                   {"role": "tool", "content": "1", "tool_call_id": "i"}]
    assert normalize(out) == out
    with pytest.raises(ChatRequestError, match="tools"):
        ChatRenderer(char_tokenizer()).messages_text(out, {"bad": 1}, True)


def test_naive_reencode_differs_from_the_row():
    """Negative control: re-tokenizing the conversation text gives other ids than the row (a BPE
    merges across the turn boundary), so the row checks above can fail."""
    if not SMOLLM2.is_dir():
        pytest.skip(f"SmolLM2's tokenizer is not cached at {SMOLLM2}")
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(SMOLLM2))
    ep, sampled = EpisodeTokens(renderer), []
    reply = _sample(ep, ep.prompt(SYSTEM), "  391", False, sampled)
    prompt = ep.prompt(SYSTEM + [_assistant(reply), {"role": "user", "content": "ok"}])
    assert not prompt.forked
    _sample(ep, prompt, "\n\nok", True, sampled)
    (row,) = ep.rows()
    check_row(renderer, row, sampled)
    full = renderer.messages_text(list(row.messages), [], False)
    assert renderer.encode(full)[:len(row.token_ids)] != list(row.token_ids)


# the char template, but assistant turns drop their reasoning: always, or once not last
_THINK = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == "
          "'assistant' and DROP %}{{ m['content'].split('</think>')[-1] }}{% else %}"
          "{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("drop,why", [
    ("not loop.last", "template re-renders earlier turns (e.g. drops reasoning) once a turn is "
                      "appended"),
    ("true", "template re-renders earlier turns (e.g. drops reasoning): the last reply does "
             "not render as sampled")])
def test_templates_that_drop_reasoning_fork(drop, why):
    tok = char_tokenizer()
    tok.chat_template = _THINK.replace("DROP", drop)
    renderer = ChatRenderer(tok)
    ep, sampled = EpisodeTokens(renderer), []
    messages = [{"role": "user", "content": "2+3?"}]
    reply = _sample(ep, ep.prompt(messages), "<think>easy</think>5", False, sampled)
    assert reply.content == "<think>easy</think>5"
    prompt = ep.prompt(messages + [_assistant(reply), {"role": "user", "content": "6+1?"}])
    assert (prompt.forked, prompt.reason) == (True, why)
    assert "<think>" not in tok.decode(list(prompt.ids))  # the fork shows the template's text


def test_stop_string_cut_reply_still_extends():
    renderer = ChatRenderer(char_tokenizer())
    ep, sampled = EpisodeTokens(renderer), []
    reply = _sample(ep, ep.prompt(SYSTEM), "391 STOP", True, sampled, stop_text_cut=5)
    assert reply == Reply("391", (), 0)
    prompt = ep.prompt(SYSTEM + [_assistant(reply), {"role": "user", "content": "ok"}])
    assert not prompt.forked
    _sample(ep, prompt, "ok", False, sampled)
    (row,) = ep.rows()
    check_row(renderer, row, sampled)
    assert row.messages[2] == {"role": "assistant", "content": "391 STOP"}  # as sampled
    with pytest.raises(ValueError, match="stop_text_cut"):
        ep.complete(prompt, [40], [-1.0], "stop", stop_text_cut=2)
    with pytest.raises(ValueError, match="logprob"):
        ep.complete(prompt, [40], [], "stop")
    assert ep.rows() == [row] and ep.calls == 2  # a refused completion changes nothing


def test_alternating_conversations_extend_their_own_rows(renderer):
    """An agent program that interleaves two conversations (a sub-agent) forks once, then each
    request extends its own row."""
    ep, sampled = EpisodeTokens(renderer), []
    convs = [list(SYSTEM), [SYSTEM[0], {"role": "user", "content": "What is 2*3?"}]]
    for turn in range(3):
        for k, messages in enumerate(convs):
            prompt = ep.prompt(messages, [CALCULATOR_SCHEMA])
            assert prompt.row == k and prompt.forked == (k == 1 and turn == 0)
            reply = _sample(ep, prompt, tool_call_text(f"{turn}+{k}"), turn == 1, sampled)
            messages += [_assistant(reply), {"role": "tool", "tool_call_id": reply.tool_calls[0].id,
                                             "content": str(turn + k)}]
    assert ep.forks == 1 and [r.forked_from_reason for r in ep.rows()] == \
        ["", "history edited at message 1"]
    for k, row in enumerate(ep.rows()):
        assert row.turns == 3
        check_row(renderer, row, [s for s in sampled if s[0] == k])


def test_rows_record_the_version_of_each_sampled_turn():
    """An episode across rollout stages (asynchronous RL): each completion's tokens carry the
    version that sampled it, -1 off the mask; a branch keeps the versions of its prefix."""
    renderer = ChatRenderer(char_tokenizer())
    ep = EpisodeTokens(renderer)
    first = ep.prompt(SYSTEM[1:])
    reply = ep.complete(first, renderer.encode("ab"), [-0.5, -0.5], "length", version=3)
    second = ep.prompt(SYSTEM[1:] + [_assistant(reply), {"role": "user", "content": "c"}])
    ep.complete(second, renderer.encode("de"), [-0.5, -0.5], "length", version=4)
    ep.complete(second, renderer.encode("f"), [-0.5], "length", version=5)   # branches
    rows = ep.rows()
    for row in rows:
        assert len(row.versions) == len(row.token_ids)
        assert all((v >= 0) == bool(m) for v, m in zip(row.versions, row.loss_mask))
    assert [v for v in rows[0].versions if v >= 0] == [3, 3, 4, 4]
    assert [v for v in rows[1].versions if v >= 0] == [3, 3, 5]
