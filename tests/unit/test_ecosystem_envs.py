"""reasoning-gym tasks and TextArena games as environments (envs/reasoning_gym_env.py,
envs/textarena_env.py): seeded tasks, the library's own scores, held-out evaluation seeds,
bad settings, and TextArena games played to the end with scripted moves."""

import random

import pytest

from earl_megatron.envs import make_env
from earl_megatron.seeds import episode_seeds, evaluation_seeds, expert_seeds

EASY = {"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 2}}


def test_reasoning_gym_tasks_are_the_generators_rows_and_reproducible():
    import reasoning_gym

    env = make_env("reasoning_gym", tasks=["basic_arithmetic"], size=50, seed=7, config=EASY)
    again = make_env("reasoning_gym", tasks=["basic_arithmetic"], size=50, seed=7, config=EASY)
    for seed in (0, 3, 57):   # training seeds: row seed % size of the pool at seed 7
        q = env.reset(seed)
        assert q == again.reset(seed)
        # a one-task composite seeded 7 draws its task's rows from the generator seeded 8
        row = reasoning_gym.create_dataset("basic_arithmetic", seed=8, size=50,
                                           **EASY["basic_arithmetic"])[seed % 50]
        assert q == row["question"] and env.entry["answer"] == row["answer"]
    assert env.reset(0) != make_env("reasoning_gym", tasks=["basic_arithmetic"], size=50,
                                    seed=8, config=EASY).reset(0)


def test_reasoning_gym_reward_is_the_librarys_score():
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    env = make_env("reasoning_gym", tasks=["basic_arithmetic", "leg_counting"], size=20)
    seen = set()
    for seed in range(8):
        env.reset(seed)
        entry, task = env.entry, env.entry["metadata"]["source_dataset"]
        seen.add(task)
        score = reasoning_gym.get_score_answer_fn(task)
        gold = entry["answer"]
        for reply in (f"<answer>{gold}</answer>", f"so <answer> {gold} </answer>.",
                      f"<answer>{gold} legs</answer>", "<answer>-1</answer>", "no tag"):
            env.reset(seed)
            res = env.step(reply)
            assert res.done and res.reward == score(extract_answer(reply), entry), reply
        env.reset(seed)
        assert env.step(f"<answer>{gold}</answer>").reward == 1.0
        env.reset(seed)
        res = env.step("I do not know")
        assert res.reward == 0.0 and res.info["unparsable"]
    assert seen == {"basic_arithmetic", "leg_counting"}


def test_reasoning_gym_evaluation_plays_held_out_tasks():
    from earl_megatron.envs.reasoning_gym_env import pool_row

    size = 100
    env = make_env("reasoning_gym", tasks=["basic_arithmetic"], size=size)
    train = episode_seeds(0, 0, size) + episode_seeds(5, 3, 64) + expert_seeds(0, 64)
    held = evaluation_seeds(0, size) + evaluation_seeds(5, 64)
    assert all(not pool_row(s, size)[0] for s in train) and all(pool_row(s, size)[0] for s in held)
    # the pools' generator streams (Random(seed + 1 + row)) are disjoint ranges
    assert {env.seed + 1 + r for r in range(size)}.isdisjoint(
        {env.seed + size + 1 + r for r in range(size)})
    train_q = {env.reset(s) for s in episode_seeds(0, 0, size)}
    held_q = {env.reset(s) for s in evaluation_seeds(0, size)}
    assert len(train_q) > 90 and len(held_q) > 90 and not train_q & held_q


@pytest.mark.parametrize("kwargs, message", [
    ({"tasks": ["basic_arithmetc"]}, "unknown reasoning-gym task 'basic_arithmetc'.*did you mean"),
    ({"tasks": []}, "tasks is empty"),
    ({"size": 0}, "size=0: the number of training tasks must be a positive integer"),
    ({"size": -3}, "size=-3"),
    ({"config": {"leg_counting": {}}}, "does not list"),
    ({"config": {"basic_arithmetic": {"seed": 3}}}, "sets seed or size"),
    ({"config": {"basic_arithmetic": {"min_terms": 5, "max_terms": 2}}}, "reasoning-gym refused"),
])
def test_reasoning_gym_bad_settings_say_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        make_env("reasoning_gym", **kwargs)
    assert "\n" not in str(e.value)


def _raw_game(moves):
    """The same moves on TextArena's own game: the agent's (player 0's) reward from close()."""
    import textarena

    raw = textarena.make("TicTacToe-v0-raw")
    raw.reset(num_players=2, seed=0)
    for move in moves:
        raw.get_observation()
        if raw.step(move)[0]:
            break
    return raw.close()[0][0]


def test_textarena_game_to_the_end_gives_the_games_reward():
    # O (agent) takes 4, 1, 7: the middle column; X (scripted) plays 0 and 8
    env = make_env("textarena", game="TicTacToe-v0", opponent=["[0]", "[8]"])
    first = env.reset(3)
    assert "Available Moves: '[0]'" in first and "You are Player 0" in env.system_prompt
    steps = [env.step(m) for m in ("[4]", "[1]", "[7]")]
    assert [s.done for s in steps] == [False, False, True]
    assert "Player 1 placed their symbol (X) in cell 0." in steps[0].observation
    assert steps[-1].reward == 1.0 == _raw_game(["[4]", "[0]", "[1]", "[8]", "[7]"])
    assert steps[-1].info["outcome"] == "win" and steps[-1].info["invalid_moves"] == 0

    # TextArena's invalid-move rule: one warning and a resubmit, the second ends in a loss
    env.reset(3)
    env.step("[4]")
    warned = env.step("[4]")
    assert not warned.done and "attempted an invalid move" in warned.observation
    assert warned.info["invalid_moves"] == 1
    lost = env.step("[9]")
    assert lost.done and lost.reward == -1.0 and lost.info["illegal"]
    assert lost.info["outcome"] == "loss" and lost.info["invalid_moves"] == 2


def test_textarena_random_opponent_is_seeded_and_leaves_random_alone():
    random.seed(11)
    untouched = random.random()
    random.seed(11)   # TextArena seeds the global generator: the environment puts it back
    a = make_env("textarena", game="TicTacToe-v0", agent_player=1)
    b = make_env("textarena", game="TicTacToe-v0", agent_player=1)
    assert a.reset(5) == b.reset(5) and a.step("[4]").observation == b.step("[4]").observation
    assert random.random() == untouched
    assert a.reset(5) != a.reset(6)   # the opponent's first move follows the seed
    with pytest.raises(ValueError, match="unknown TextArena game 'TicTacToe-v9'"):
        make_env("textarena", game="TicTacToe-v9")
    with pytest.raises(ValueError, match="opponent='gpt'"):
        make_env("textarena", opponent="gpt")


def test_reasoning_gym_expert_answers_every_recipe_task_right_by_the_librarys_score():
    """The warm start's teacher (ReasoningGymEnv.expert) on the SmolLM2 recipe's own tasks and
    settings: reasoning-gym's extract_answer + score_answer give its reply 1.0, and the trainer's
    expert traces (warm-start seeds) play it to the end with reward 1."""
    import reasoning_gym
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from reasoning_gym.utils import extract_answer

    from earl_megatron.rollout.trajectories import expert_trajectories
    from earl_megatron.train import RECIPES

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        cfg = compose(config_name="smollm2_reasoning_gym")
    kwargs = OmegaConf.to_container(cfg.env.kwargs, resolve=True)
    env = make_env("reasoning_gym", **kwargs)
    seeds = expert_seeds(0, 40) + episode_seeds(0, 0, 20) + evaluation_seeds(0, 20)
    seen = set()
    for seed in seeds:
        entry = env.task(seed)
        (reply,) = env.expert(seed)
        assert reply == f"<answer>{entry['answer']}</answer>"
        task = entry["metadata"]["source_dataset"]
        seen.add(task)
        assert reasoning_gym.get_score_answer_fn(task)(extract_answer(reply), entry) == 1.0, reply
    assert seen == set(kwargs["tasks"])
    traces = expert_trajectories(lambda: make_env("reasoning_gym", **kwargs), expert_seeds(0, 8))
    assert [t.meta["reward"] for t in traces] == [1.0] * 8
    assert [m[0] for m in traces[0].messages] == ["system", "user", "assistant"]
