"""A tiny character-level HF tokenizer for the CPU default, and chat rendering for any tokenizer.

``char_tokenizer()`` builds a ``tokenizers.Tokenizer`` (WordLevel over single characters, one
token per character, unknown characters -> <unk>) wrapped as a ``PreTrainedTokenizerFast``, so it
saves and loads like any HF tokenizer and carries its own chat template. Vocabulary (104 ids, fits
the tiny model's 128):

    0-7     <pad> <unk> <bos> <eos> <|system|> <|user|> <|assistant|> <|end|>
    8       "\\n"
    9-103   printable ASCII, space (9) to "~" (103), in code-point order
    104+    not tokens: a model with a larger vocabulary may sample them; they decode to ""

``tool_tokenizer()`` is the same with the calculator's tags as single tokens (ids 8-15, right after
the specials, then TOOL_ALPHABET: 64 ids). Tags are ordinary added tokens, not special ones: they
survive ``decode(skip_special_tokens=True)``, which is how the agent loop hands actions to the
environment, and text round-trips (encode then decode gives the text back for any string over the
alphabet). One token per tag keeps every calculator action within a 16-token turn and makes the
choice "call the tool or answer" a single sampled token.

Chat rendering works for this tokenizer and for a real HF tokenizer with a ``chat_template``.
The agent loop builds a context turn by turn, so it needs the template cut into pieces:

    render_prompt(system, obs0)  = template([system, user obs0], generation prompt)
    <assistant tokens sampled by the engine, ending with the end-of-turn token>
    render_next_turn(obs1, role) = what the template puts between that end-of-turn token and the
                                   next generation prompt, the ``role`` turn obs1 included
                                   ("user", or "tool" for a tool's result)

SmolLM2's ChatML template (a default system prompt when none is given) cuts as:

    <|im_start|>system\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\n
    <|im_start|>user\nWhat is 17*23?<|im_end|>\n<|im_start|>assistant\n      render_prompt
    <tool_call>...</tool_call><|im_end|>                                        sampled
    \n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n                render_next_turn

The ``\n`` after ``<|im_end|>`` is the template's (``ChatFormat.turn_suffix``), not the model's:
it opens the next piece and is never trained. A turn cut by the token budget has no end-of-turn
token; ``render_next_turn(stopped=False)`` starts with it, as a template token.

Invariant (tested with the character templates, a ChatML BPE tokenizer and SmolLM2's own):
prompt + sampled tokens + next turn + ... decodes to the template applied to the whole
conversation (each assistant content being the decoded sampled tokens), so training sees exactly
the text the template defines. Token-in/token-out: the pieces are encoded on their own and the
sampled ids are kept as sampled; re-tokenizing the whole text can give other ids at a turn
boundary (a BPE merges an assistant turn's leading space with the newline before it), so nothing
here ever does. The pieces come from rendering the template on a short conversation and cutting
it, so any template that renders earlier turns identically when a turn is appended works; one
that does not, or that does not render a role's content verbatim, gets a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS) + ROLE_TOKENS + (END_OF_TURN,)
CHARS = ("\n",) + tuple(chr(c) for c in range(32, 127))
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

_DUMMY_USER = "Q"
_DUMMY_ASSISTANT = "ASSISTANT-REPLY"


GAME_ALPHABET = "\n 0123456789.xo:moves"
"""Every character the board games render (board, move history): 28 ids with the specials."""

TOOL_TAGS = ("<calc>", "</calc>", "<answer>", "</answer>", "<result>", "</result>", "<error>",
             "</error>")
"""The calculator's action and observation tags (envs/tool_env.py), one token each."""
TOOL_ALPHABET = "\n 0123456789+-*/()%.,:abcdefghijklmnopqrstuvwxyz"
"""Questions, expressions, numbers and the calculator's messages: 64 ids with specials and tags."""


def tool_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer over TOOL_ALPHABET with TOOL_TAGS as single tokens (64 ids)."""
    return char_tokenizer(TOOL_ALPHABET, tags=TOOL_TAGS)


def char_tokenizer(alphabet: str | None = None,
                   tags: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """The character-level tokenizer with a chat template (see the module docstring).

    ``alphabet`` restricts the vocabulary to its characters (in first-seen order, after the
    special tokens); other characters become <unk>. A compact alphabet gives a small model a
    small output layer, so an untrained policy already emits a digit often enough for RL to
    start: with the printable-ASCII vocabulary a random policy writes a move ~7% of the time,
    with GAME_ALPHABET ~40%.

    ``tags``: multi-character strings that become one (non-special) token each, ids right after
    the special tokens; they are matched in the text before it is split into characters.
    """
    chars = CHARS if alphabet is None else tuple(dict.fromkeys(alphabet))
    bad = [t for t in tags if len(t) < 2 or t in SPECIAL_TOKENS or t in chars]
    if bad or len(set(tags)) != len(tags):
        raise ValueError(f"tags {list(tags)}: each must be a distinct string of 2+ characters "
                         f"that is neither a special token nor a character ({bad} are not)")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(tags) + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # every character is its own pre-token; [\s\S] because "." would skip newlines
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tags:
        # already in the vocabulary, so they keep their ids; special=False: decoding with
        # skip_special_tokens keeps them
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=UNK,
                                   additional_special_tokens=list(ROLE_TOKENS + (END_OF_TURN,)))
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass(frozen=True)
class ChatFormat:
    """Where a tokenizer's chat template ends an assistant turn, found once per tokenizer."""

    end_of_turn: str
    """The special token text closing an assistant turn (<|end|>, <|im_end|>, <|eot_id|>)."""
    stop_token_ids: tuple[int, ...]
    """Token ids that end a generated turn: the end-of-turn token, plus EOS if different."""
    turn_suffix: str = ""
    """What the template writes after an assistant turn's end-of-turn token ("\n" for ChatML,
    "" for the character template): template text, never trained. An episode ends on its last
    sampled token, so the template's text of the whole conversation is the decoded episode plus
    the end-of-turn token (when the last turn was cut) plus this suffix."""


def _template(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
              generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{type(tokenizer).__name__} has no chat_template; set "
                         "tokenizer.chat_template (a Jinja string) or use char_tokenizer()")
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # the template text already holds BOS and role tokens: add nothing
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _messages(system: str, *turns: tuple[str, str]) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": role, "content": content} for role, content in turns]


def chat_format(tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
    """Find the end-of-turn token by rendering a one-turn conversation and cutting it."""
    text = _template(tokenizer, _messages("", ("user", _DUMMY_USER),
                                          ("assistant", _DUMMY_ASSISTANT)), False)
    at = text.rfind(_DUMMY_ASSISTANT)
    if at < 0:
        raise ValueError("the chat template does not render assistant content verbatim; "
                         "cannot find where an assistant turn ends")
    after = text[at + len(_DUMMY_ASSISTANT):]
    specials = sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()),
                      key=len, reverse=True)
    end = next((s for s in specials if s and after.startswith(s)), None)
    if end is None:
        raise ValueError(f"the chat template ends assistant turns with {after[:20]!r}, not with a "
                         "special token; the engine needs a single stop token to end a turn. "
                         "Add an end-of-turn special token to the template")
    ids = [tokenizer.convert_tokens_to_ids(end)]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ChatFormat(end_of_turn=end, stop_token_ids=tuple(ids), turn_suffix=after[len(end):])


def render_prompt(tokenizer: PreTrainedTokenizerBase, system: str, observation: str) -> list[int]:
    """Token ids of the first turn: system (omitted when empty), user observation, generation
    prompt."""
    return _encode(tokenizer, _template(tokenizer, _messages(system, ("user", observation)), True))


def render_next_turn(tokenizer: PreTrainedTokenizerBase, fmt: ChatFormat, observation: str,
                     stopped: bool, role: str = "user") -> list[int]:
    """Token ids between the end of a sampled assistant turn and the next generation prompt.

    ``stopped`` says whether the sampled turn ended with the end-of-turn token; when it did not
    (the turn hit its token budget) the end-of-turn token is part of these template tokens.
    ``role`` is the observation's chat role (``StepResult.role``): "user", or "tool" for a
    tool's result, rendered the way the template renders that role.
    """
    turns = (("user", _DUMMY_USER), ("assistant", _DUMMY_ASSISTANT))
    base = _template(tokenizer, _messages("", *turns), False)
    try:
        full = _template(tokenizer, _messages("", *turns, (role, observation)), True)
    except TemplateError as e:  # a template that refuses the role raises from Jinja
        raise ValueError(f"the chat template refuses a {role!r} message ({e}); use a template "
                         f"that renders role {role!r} or an environment whose observations are "
                         "user turns (the calculator's tool_format='tags')") from None
    if not full.startswith(base):
        raise ValueError("the chat template renders earlier turns differently once a turn is "
                         "appended; multi-turn contexts cannot be built incrementally with it")
    if observation.strip() not in full[len(base):]:  # strip: templates may trim contents
        raise ValueError(f"the chat template does not render a {role!r} message's content "
                         f"verbatim, so the observation would be lost; use a template that "
                         f"renders role {role!r} or an environment whose observations are user "
                         "turns (the calculator's tool_format='tags')")
    after_content = base[base.rfind(_DUMMY_ASSISTANT) + len(_DUMMY_ASSISTANT):]
    if stopped:
        after_content = after_content[len(fmt.end_of_turn):]
    return _encode(tokenizer, after_content + full[len(base):])
