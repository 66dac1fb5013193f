"""Chat trajectories for supervised training: the JSONL users bring, traces played by an
environment's scripted expert, and their tokens under the agent loop's rendering and loss mask.

File format: one trajectory per line, in the "messages" form of chat datasets::

    {"messages": [{"role": "system", "content": "calculator: ..."},     (optional, first only)
                  {"role": "user", "content": "compute 3+4*2"},
                  {"role": "assistant", "content": "<calc>3+4*2</calc>"},
                  {"role": "user", "content": "<result>11</result>"},
                  {"role": "assistant", "content": "<answer>11</answer>"}]}

Rules, checked on reading (errors name the file, the line and the fix): an optional system turn
first, then user and assistant turns alternating, starting with a user turn and ending with an
assistant turn (a "tool" turn, a tool's result, may stand where any user turn but the first
does); every content is a string. Other keys of a line (``seed``, ``reward``...) are kept
in ``Trajectory.meta`` and never trained on. Blank lines are skipped.

Tokens (``trajectory_tokens``) are exactly the episode the agent loop would have built had the
engine sampled each assistant content followed by the end-of-turn token::

    render_prompt(system, user0) | assistant0 + <end> | render_next_turn(user1) | assistant1 + <end>
    loss_mask 0                    1                    0                         1

so the supervised loss covers the same tokens RL trains (the agent's, end-of-turn included) and
none of the prompt, observations or tool outputs. Invariant (tested): the tokens decode to the
tokenizer's chat template applied to the whole conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from earl_megatron.envs.base import Env
from earl_megatron.rollout.tokenizer import chat_format, render_next_turn, render_prompt

ROLES = ("system", "user", "assistant", "tool")


class TrajectoryFormatError(ValueError):
    """A trajectory (or a line of a JSONL file) that breaks the format above."""


@dataclass(frozen=True)
class Trajectory:
    messages: tuple[tuple[str, str], ...]
    """(role, content) pairs in conversation order."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """Everything else the line carried (seed, reward, ...); not trained on."""

    def __post_init__(self):
        check_messages(self.messages)

    @property
    def system(self) -> str:
        return self.messages[0][1] if self.messages[0][0] == "system" else ""

    @property
    def turns(self) -> tuple[tuple[str, str], ...]:
        """The user/assistant turns (the system turn left out)."""
        return self.messages[1:] if self.messages[0][0] == "system" else self.messages

    def to_json(self) -> str:
        return json.dumps({"messages": [{"role": r, "content": c} for r, c in self.messages],
                           **self.meta})


def check_messages(messages: Sequence[tuple[str, str]]) -> None:
    if not messages:
        raise TrajectoryFormatError("a trajectory needs at least a user and an assistant turn")
    for i, m in enumerate(messages):
        if len(m) != 2 or m[0] not in ROLES or not isinstance(m[1], str):
            raise TrajectoryFormatError(f"message {i} is {m!r}; each message is a role in "
                                        f"{ROLES} with a string content")
    turns = messages[1:] if messages[0][0] == "system" else messages
    for i, (role, _) in enumerate(turns):
        # an observation is a user turn, or a tool turn (a tool's result) after the first
        want = ("'user'",) if i == 0 else ("'assistant'",) if i % 2 else ("'user'", "'tool'")
        if repr(role) not in want:
            raise TrajectoryFormatError(
                f"turn {i} is {role!r} where {' or '.join(want)} belongs: after an optional "
                "system turn, user (or tool) and assistant turns alternate, starting with user")
    if len(turns) < 2 or turns[-1][0] != "assistant":
        raise TrajectoryFormatError("a trajectory must end with an assistant turn (the last "
                                    "thing trained on is the agent's); drop the trailing turn")


def parse_line(line: str, where: str = "line") -> Trajectory:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TrajectoryFormatError(f"{where}: not JSON ({e.msg}); write one JSON object per "
                                    "line") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        raise TrajectoryFormatError(f"{where}: expected an object with a \"messages\" list, got "
                                    f"{type(obj).__name__}")
    msgs = []
    for i, m in enumerate(obj["messages"]):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m \
                or "content" not in m:
            raise TrajectoryFormatError(f"{where}: message {i} must be "
                                        "{\"role\": ..., \"content\": ...}, got " + repr(m))
        msgs.append((m["role"], m["content"]))
    meta = {k: v for k, v in obj.items() if k != "messages"}
    try:
        return Trajectory(tuple(msgs), meta)
    except TrajectoryFormatError as e:
        raise TrajectoryFormatError(f"{where}: {e}") from None


def read_jsonl(path: str | Path) -> list[Trajectory]:
    """Every trajectory of a JSONL file (see the module docstring for the format)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trajectory file {path} does not exist; write one with "
                                "write_jsonl or point sft.data at an existing .jsonl")
    out = [parse_line(line, f"{path}:{n}")
           for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not out:
        raise TrajectoryFormatError(f"{path} holds no trajectories")
    return out


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(t.to_json() + "\n" for t in trajectories))
    return path


def expert_trajectories(make_env: Callable[[], Env], seeds: Sequence[int]) -> list[Trajectory]:
    """Play ``env.expert(seed)`` for every seed; meta holds seed, reward and the final info."""
    env = make_env()
    out = []
    for seed in seeds:
        obs = env.reset(seed)
        msgs = ([("system", env.system_prompt)] if env.system_prompt else []) + [("user", obs)]
        actions = list(env.expert(seed))
        reward, info = 0.0, {}
        for k, action in enumerate(actions):
            res = env.step(action)
            msgs.append(("assistant", action))
            reward += res.reward
            info.update(res.info)
            if res.done:
                if k != len(actions) - 1:
                    raise RuntimeError(f"{env.name} expert: episode {seed} ended after action "
                                       f"{k} of {len(actions)}; the expert is inconsistent")
                break
            msgs.append((res.role, res.observation))
        else:
            raise RuntimeError(f"{env.name} expert: its {len(actions)} actions for seed {seed} "
                               "do not finish the episode")
        out.append(Trajectory(tuple(msgs), {"seed": int(seed), "reward": reward,
                                            "info": dict(info)}))
    return out


def trajectory_tokens(traj: Trajectory, tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one trajectory: the agent loop's rendering (module docstring)."""
    fmt = chat_format(tokenizer)
    eot = fmt.stop_token_ids[0]
    turns = traj.turns
    ids = list(render_prompt(tokenizer, traj.system, turns[0][1]))
    mask = [0] * len(ids)
    for k in range(1, len(turns), 2):
        action = list(tokenizer(turns[k][1], add_special_tokens=False)["input_ids"]) + [eot]
        ids += action
        mask += [1] * len(action)
        if k + 1 < len(turns):
            nxt = render_next_turn(tokenizer, fmt, turns[k + 1][1], stopped=True,
                                   role=turns[k + 1][0])
            ids += nxt
            mask += [0] * len(nxt)
    return ids, mask
