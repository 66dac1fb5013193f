"""Character tokenizer (ids, round trip, save/load) and incremental chat rendering that equals the
template applied to the whole conversation, for the char tokenizer and a BPE ChatML tokenizer."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from earl_megatron.rollout.tokenizer import (CHARS, SPECIAL_TOKENS, chat_format, char_tokenizer,
                                             render_next_turn, render_prompt)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BOARD = "moves: 3 4\n.......\n...xo..\n0123456"


@pytest.fixture(scope="module")
def chatml_tokenizer():
    """A Qwen-style byte-level BPE tokenizer with a ChatML template, trained here in ~0.1 s."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["connect four. you are x. reply with a column digit 0-6.", BOARD,
              "compute 12*(3+4) <calc>12*7</calc> <answer>84</answer>"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    return fast


def test_char_vocab_layout_and_round_trip():
    tok = char_tokenizer()
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARS) == 104 <= 128
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2, 3)
    ids = tok(BOARD, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(BOARD)  # one token per character
    assert ids[:3] == [8 + ord("m") - 31, 8 + ord("o") - 31, 8 + ord("v") - 31]
    assert tok(" \n~", add_special_tokens=False)["input_ids"] == [9, 8, 103]
    assert tok.decode(ids) == BOARD
    assert tok("aé<|end|>", add_special_tokens=False)["input_ids"] == [8 + ord("a") - 31, 1, 7]
    # the tiny model samples ids 104-127 too: they decode to nothing instead of raising
    assert tok.decode([120, 40, 127]) == chr(40 + 23)


def test_char_tokenizer_save_load(tmp_path):
    tok = char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<bos><|user|>" + BOARD + "<|end|><|assistant|>3<|end|>"
    assert loaded(text, add_special_tokens=False)["input_ids"] == \
        tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.chat_template == tok.chat_template
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == BOARD + "3"


def test_char_chat_rendering_exact():
    tok = char_tokenizer()
    fmt = chat_format(tok)
    assert fmt.end_of_turn == "<|end|>" and fmt.stop_token_ids == (7, 3)
    prompt = render_prompt(tok, "sys", "ab")
    assert tok.convert_ids_to_tokens(prompt) == ["<bos>", "<|system|>", "s", "y", "s", "<|end|>",
                                                 "<|user|>", "a", "b", "<|end|>", "<|assistant|>"]
    assert render_prompt(tok, "", "ab")[:3] == [2, 5, 8 + ord("a") - 31]  # no system turn
    assert tok.convert_ids_to_tokens(render_next_turn(tok, fmt, "c", stopped=True)) == \
        ["<|user|>", "c", "<|end|>", "<|assistant|>"]
    assert tok.convert_ids_to_tokens(render_next_turn(tok, fmt, "c", stopped=False)) == \
        ["<|end|>", "<|user|>", "c", "<|end|>", "<|assistant|>"]


@pytest.mark.parametrize("which", ["char", "chatml"])
def test_incremental_turns_equal_whole_conversation(which, chatml_tokenizer):
    tok = char_tokenizer() if which == "char" else chatml_tokenizer
    fmt = chat_format(tok)
    system, observations, replies = "connect four. you are x.", [BOARD, "moves: 3 4 3 2", "end"], \
        ["3", "3 again"]
    ids = render_prompt(tok, system, observations[0])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": observations[0]}]
    for reply, obs in zip(replies, observations[1:]):
        sampled = tok(reply, add_special_tokens=False)["input_ids"] + [fmt.stop_token_ids[0]]
        ids += sampled + render_next_turn(tok, fmt, obs, stopped=True)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": obs}]
    whole = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == whole


def test_chatml_format_and_stop_ids(chatml_tokenizer):
    fmt = chat_format(chatml_tokenizer)
    im_end = chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fmt.end_of_turn == "<|im_end|>"
    assert fmt.stop_token_ids == (im_end, chatml_tokenizer.eos_token_id)
    turn = render_next_turn(chatml_tokenizer, fmt, "hi", stopped=True)
    assert chatml_tokenizer.decode(turn) == "\n<|im_start|>user\nhi<|im_end|>\n" \
                                            "<|im_start|>assistant\n"


def test_errors_name_the_fix(chatml_tokenizer):
    tok = char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        chat_format(tok)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="not with a special token"):
        chat_format(tok)


def test_tool_tokenizer_tags_are_single_tokens_and_round_trip(tmp_path):
    from earl_megatron.rollout.tokenizer import TOOL_TAGS, tool_tokenizer

    tok = tool_tokenizer()
    assert len(tok) == 64
    assert tok.convert_ids_to_tokens(list(range(8, 16))) == list(TOOL_TAGS)
    text = "<calc>37*(12-5)+8</calc>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 8 and ids[-1] == 9 and len(ids) == 2 + len("37*(12-5)+8")
    # any text over the alphabet round-trips; the agent loop decodes actions with
    # skip_special_tokens=True, so tags must survive it
    for s in [text, "<answer>-267</answer>", "x <result>1.5</result> <error>division by zero"
              "</error>", "<answer>12</answer>trailing", "calc<calc>calc"]:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == s
    eot = tok.convert_tokens_to_ids("<|end|>")
    assert tok.decode(tok("<answer>7</answer>", add_special_tokens=False)["input_ids"] + [eot],
                      skip_special_tokens=True) == "<answer>7</answer>"
    # the longest calculator action of the default questions fits a 16-token turn
    assert len(tok("<calc>(99*99)*99</calc>", add_special_tokens=False)["input_ids"]) + 1 <= 16
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text, add_special_tokens=False)["input_ids"] == \
        tok(text, add_special_tokens=False)["input_ids"]
    assert chat_format(loaded).stop_token_ids == (7, 3)


def test_tags_must_be_new_multi_character_strings():
    with pytest.raises(ValueError, match="distinct string of 2"):
        char_tokenizer("ab", tags=("a",))
    with pytest.raises(ValueError, match="distinct string of 2"):
        char_tokenizer("ab", tags=("<calc>", "<calc>"))
