"""The agent loop's token-in/token-out check, and a scripted engine whose samples are known.

``ScriptedEngine(tokenizer, reply)`` is a RolloutEngine whose policy is a function of the
context: for each prompt it decodes the ids, calls ``reply(text)`` for the assistant's text (a
string, or a list of pieces encoded one by one: a tokenization the tokenizer itself would not
produce, as a real model may sample), appends the end-of-turn token and cuts the turn at
``max_new_tokens`` ("length") like any engine. Its logprob of the k-th token of a turn is
``-(k + 1) / 100``, so a test can see that each one lands on its own token. Every call's prompts
and generations are kept in ``calls``.

``Recording(engine)`` wraps any RolloutEngine (a real model's) and keeps ``calls`` the same way,
so the check runs on a real policy's own samples too.

``check_episode(episode, tokenizer, system_prompt, engine)`` asserts the agent loop's invariant
(rollout/agent_loop.py, docs/rollout.md) and returns the conversation as chat messages:
- the loss-masked runs are exactly the engine's sampled ids, in order (never re-tokenized), with
  the engine's logprobs there and 0.0 elsewhere; a sampled end-of-turn token is trained, the
  template's text after it (ChatML's newline) is not;
- everything else is the template's own tokens: ``render_prompt`` first, then between turns
  ``render_next_turn(observation, stopped, role)`` with the observation's role;
- the decoded episode + (end-of-turn if the last turn was cut) + ``turn_suffix`` is the chat
  template applied to the whole conversation, the assistant contents being the decoded samples.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

from earl_megatron.rollout.engine import EngineHealth, Generation, SamplingParams, check_prompts
from earl_megatron.rollout.tokenizer import chat_format, render_next_turn, render_prompt

Reply = Callable[[str], Union[str, Sequence[str]]]


class ScriptedEngine:
    """A RolloutEngine that "samples" ``reply(decoded context)`` (see the module docstring)."""

    def __init__(self, tokenizer, reply: Reply):
        self.tok, self.reply = tokenizer, reply
        self.eot = chat_format(tokenizer).stop_token_ids[0]
        self.calls: list[tuple[tuple[int, ...], Generation]] = []

    def _encode(self, pieces) -> list[int]:
        pieces = [pieces] if isinstance(pieces, str) else list(pieces)
        return [i for p in pieces for i in self.tok(p, add_special_tokens=False)["input_ids"]]

    def generate(self, prompts, params: SamplingParams) -> list[Generation]:
        check_prompts(prompts)
        out = []
        for prompt in prompts:
            ids = self._encode(self.reply(self.tok.decode(list(prompt)))) + [self.eot]
            stop = next((k for k, t in enumerate(ids) if t in params.stop_token_ids), None)
            if stop is not None and stop < params.max_new_tokens:
                ids, reason = ids[:stop + 1], "stop"
            else:
                ids, reason = ids[:params.max_new_tokens], "length"
            gen = Generation(tuple(ids), tuple(-(k + 1) / 100 for k in range(len(ids))), reason)
            self.calls.append((tuple(prompt), gen))
            out.append(gen)
        return out

    def update_weights(self, source) -> None:
        raise NotImplementedError("a scripted engine has no weights")

    def release_memory(self) -> None:
        pass

    def resume_memory(self) -> None:
        pass

    def health(self) -> EngineHealth:
        return EngineHealth(True, "scripted")

    def close(self) -> None:
        pass


class Recording:
    """Any RolloutEngine, its prompts and generations kept in ``calls`` for check_episode."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[tuple[int, ...], Generation]] = []

    def generate(self, prompts, params: SamplingParams) -> list[Generation]:
        gens = self.engine.generate(prompts, params)
        self.calls += [(tuple(p), g) for p, g in zip(prompts, gens)]
        return gens

    def update_weights(self, source) -> None:
        self.engine.update_weights(source)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def health(self) -> EngineHealth:
        return self.engine.health()

    def close(self) -> None:
        self.engine.close()


def _runs(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal mask values."""
    runs, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            runs.append((mask[start], start, k))
            start = k
    return runs


def check_episode(episode, tokenizer, system_prompt: str, engine) -> list[dict]:
    """Assert the token-in/token-out invariant on one episode; return its chat messages."""
    fmt = chat_format(tokenizer)
    eot = fmt.stop_token_ids[0]
    ids = list(episode.token_ids)
    assert len(ids) == len(episode.loss_mask) == len(episode.logprobs)
    assert episode.turns >= 1, "an episode with no sampled turn has nothing to check"
    gens = sorted(((p, g) for p, g in engine.calls
                   if ids[:len(p) + len(g.token_ids)] == list(p) + list(g.token_ids)),
                  key=lambda pg: len(pg[0]))
    gens = [g for _, g in gens]
    assert len(gens) == episode.turns, (len(gens), episode.turns)
    runs = _runs(episode.loss_mask)
    trained = [(s, e) for v, s, e in runs if v == 1]
    template = [(s, e) for v, s, e in runs if v == 0]
    assert [tuple(ids[s:e]) for s, e in trained] == [g.token_ids for g in gens]
    for (s, e), g in zip(trained, gens):
        assert tuple(episode.logprobs[s:e]) == g.logprobs
    assert all(lp == 0.0 for (s, e) in template for lp in episode.logprobs[s:e])
    assert len(template) == episode.turns, "a template piece before every sampled turn"
    assert ids[template[0][0]:template[0][1]] == render_prompt(tokenizer, system_prompt,
                                                               episode.observations[0])
    roles = episode.observation_roles
    assert len(roles) == len(episode.observations) and roles[0] == "user"
    stopped = [bool(g.token_ids) and g.token_ids[-1] == eot for g in gens]
    for t, (s, e) in enumerate(template[1:]):
        assert ids[s:e] == render_next_turn(tokenizer, fmt, episode.observations[t + 1],
                                            stopped[t], roles[t + 1]), f"piece after turn {t}"
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": episode.observations[0]}]
    for t, g in enumerate(gens):
        content = list(g.token_ids[:-1] if stopped[t] else g.token_ids)
        messages.append({"role": "assistant", "content": tokenizer.decode(content)})
        assert episode.actions[t] == tokenizer.decode(list(g.token_ids), skip_special_tokens=True)
        if t + 1 < len(gens):
            messages.append({"role": roles[t + 1], "content": episode.observations[t + 1]})
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    closing = ("" if stopped[-1] else fmt.end_of_turn) + fmt.turn_suffix
    assert tokenizer.decode(ids) + closing == whole
    return messages
