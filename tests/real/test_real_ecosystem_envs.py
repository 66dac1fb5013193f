"""reasoning-gym and TextArena environments train on the real model (issue 48, items 2 and 3).

One torchrun job of 2 CPU ranks per integration, 2 RL iterations each, SmolLM2-135M-Instruct
(``run.init``: its tokenizer and ChatML template), every sampled episode of rank 0's rollout
replica written to samples/. Asserted from those files, per episode:

- reasoning-gym (``recipes/smollm2_reasoning_gym.yaml``, its four tasks, a warm start of 4 steps
  on the environment's expert instead of the recipe's 12): the recorded reward is what
  reasoning-gym itself gives the recorded reply: ``extract_answer`` then the task's
  ``score_answer`` from ``reasoning_gym.get_score_answer_fn``, on the entry the seed draws; and
  the warm start taught the format, so the reward is not always 0: replies carry the
  ``<answer>`` tag and the held-out evaluation after the warm start (16 questions, greedy and
  sampled) scores above 0 in both modes (the base model scores 0: it never writes the tag);
- TextArena (TicTacToe-v0 against the random opponent): the recorded moves, replayed into a
  fresh TextArena game with the opponent moves read back from the recorded text, end where the
  episode ended, and the game's own ``close()`` reward is the recorded reward;
- token-in/token-out: the episode's decoded tokens are exactly the chat template's text of its
  conversation (system, observations, the replies as sampled), and the trained tokens are the
  replies (with the end-of-turn token the model sampled), nothing of the template.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

COMMON = ["run.iterations=2", "run.checkpoint_every=0", "run.live_view=false",
          "run.samples_per_iteration=1000", "rollout.episodes_per_iteration=4",
          "layout.memory_budget_gb=4"]


def _train(out, smollm2_dir, *extra, eval_episodes=2):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "earl_megatron.train", *extra,
                           f"run.init={smollm2_dir}", f"run.output_dir={out}",
                           f"run.eval_episodes={eval_episodes}", *COMMON],
                          env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1]
    samples = [json.loads(line) for f in sorted((out / "samples").iterdir())
               for line in f.read_text().splitlines()]
    assert {s["iteration"] for s in samples} == {0, 1} and len(samples) == 4   # 2 per iteration
    resolved = json.loads((out / "resolved.json").read_text())
    return samples, resolved["env"]["kwargs"]


def _check_tokens(tok, s, system, observations):
    """The row is the template's text of (system, observation, reply, observation, ...)."""
    messages = [{"role": "system", "content": system}]
    for obs, action in zip(observations, s["actions"]):
        messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": action}]
    want = tok.apply_chat_template(messages, tokenize=False)
    assert want.startswith(s["text"]), (s["text"][-300:], want[-300:])
    assert want[len(s["text"]):] in ("", "\n", "<|im_end|>\n"), want[len(s["text"]):]
    trained = [seg["text"] for seg in s["segments"] if seg["trained"]]
    assert [t.removesuffix("<|im_end|>") for t in trained] == s["actions"]
    assert all("<|im_start|>" not in t for t in trained)


@pytest.mark.timeout(2700)
def test_reasoning_gym_trains_with_its_own_scores(smollm2_dir, scratch_dir, record):
    import reasoning_gym
    from reasoning_gym.utils import extract_answer
    from transformers import AutoTokenizer

    from earl_megatron.envs.reasoning_gym_env import ReasoningGymEnv

    out = scratch_dir / "rg"
    samples, kwargs = _train(out, smollm2_dir, "--config-name", "smollm2_reasoning_gym",
                             "rollout.temperature=0.7", "sft.steps=4", eval_episodes=16)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    env = ReasoningGymEnv(**kwargs)
    for s in samples:
        entry = env.task(s["seed"])
        task = entry["metadata"]["source_dataset"]
        (reply,) = s["actions"]
        score = reasoning_gym.get_score_answer_fn(task)(extract_answer(reply), entry)
        assert s["reward"] == pytest.approx(score, abs=1e-12), (reply, entry["answer"])
        _check_tokens(tok, s, env.system_prompt, [entry["question"]])
    # the warm start's expert format yields reward: tagged replies, held-out reward above 0
    tagged = sum(extract_answer(s["actions"][0]) is not None for s in samples)
    start = json.loads((out / "eval.json").read_text())["start"]
    rewards = {mode: start[f"reasoning_gym/{mode}"]["mean_reward"]
               for mode in ("greedy", "sampled")}
    assert tagged >= 3 and min(rewards.values()) > 0, (tagged, rewards,
                                                       [s["actions"] for s in samples])
    record("reasoning-gym after 4 warm-start steps: held-out mean reward (16 questions), "
           "tagged replies of 4", (rewards, tagged))
    record("reasoning-gym: (task, reward) of 4 episodes",
           [(env.task(s["seed"])["metadata"]["source_dataset"], s["reward"]) for s in samples])


def _replay_raw(game, seed, actions, text):
    """Play a fresh TextArena game: the recorded agent moves, the opponent's moves as the
    recorded episode text shows them. (done, the agent's reward from the game's close())."""
    import textarena

    raw = textarena.make(game + "-raw")
    raw.reset(num_players=2, seed=seed)
    opponent = re.findall(r"^Player 1: (.*)$", text, re.M)
    done, k = False, 0
    for action in actions:
        player, _ = raw.get_observation()
        done, _ = raw.step(action)
        if done:
            break
        player, _ = raw.get_observation()
        if player == 1:
            done, _ = raw.step(opponent[k])
            k += 1
            if done:
                break
    rewards, _ = raw.close()
    return done, float((rewards or {}).get(0, 0.0))


@pytest.mark.timeout(2700)
def test_textarena_trains_with_the_games_rewards(smollm2_dir, scratch_dir, record):
    from transformers import AutoTokenizer

    from earl_megatron.envs.textarena_env import TextArenaEnv

    samples, kwargs = _train(scratch_dir / "ta", smollm2_dir, "env=textarena",
                             "env.kwargs.game=TicTacToe-v0", "rollout.max_turns=4",
                             "rollout.max_action_tokens=8", "rollout.temperature=0.7")
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    for s in samples:
        env = TextArenaEnv(**kwargs)
        observations = [env.reset(s["seed"])]
        results = [env.step(a) for a in s["actions"]]
        observations += [r.observation for r in results]
        done, reward = _replay_raw(kwargs["game"], s["seed"], s["actions"], s["text"])
        assert done == (s["finish_reason"] == "done"), s["finish_reason"]
        assert s["reward"] == pytest.approx(reward if done else 0.0), s["actions"]
        _check_tokens(tok, s, env.system_prompt, observations)
    record("textarena: (finish, reward, invalid moves) of 4 episodes",
           [(s["finish_reason"], s["reward"], s["info"].get("invalid_moves")) for s in samples])
