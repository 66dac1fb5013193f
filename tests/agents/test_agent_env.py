"""``env.name=agent`` end to end on the tiny model, as a user runs it (``earl train``, 2 ranks):
the rollout replica is tp2, so its leader serves the endpoint and its other rank decodes every
batch beside it (agents/broker.py ReplicaDriver). The agents (earl_megatron/testing/agents.py
``probe``) are real programs using the ``openai`` client and httpx: one meets every refusal
the endpoint answers and records status and code, one forks its episode, one posts its reward,
one raises, one hangs past ``rollout.agent_timeout_s``, one (``late``) outlives its episode's timeout
and calls again once the stage has trained (refused: 410, recorded nothing), one is the built-in
agent scored by
``env.kwargs.reward``, one (``hold``) plays plain until iteration 1's samples are written, then
never returns. The run goes on through all of them:
iterations 0 and 1 train, the metrics count each case, the samples hold every episode's task and
its rows' messages, and every row decodes to the chat template's text of its messages.

The same launch then checks a stop request during a rollout of agents: the stop file's
``requested`` is written within a poll (0.05 s) of iteration 1's metrics line, so it lands in
iteration 2's rollout, whose ``hold`` agent never returns (the run would time it out, with the
``hang`` one, only after ``rollout.agent_timeout_s``, 10 s): every rank of the tp2 replica sees
the stop at the driver's next tick (the leader's HTTP thread and agents keep nothing from it),
iteration 2 is abandoned untrained, iteration 1 checkpointed, exit 0. Last, the trained policy
is served from that checkpoint."""

import json
import os
import subprocess
import sys
import time

from earl_megatron.testing.agents import SEEN_OK, serve_process

KINDS = ("plain", "refusals", "fork", "post", "raise", "hang", "late", "builtin", "hold")
MAX_TURNS = 3


def _lines(path) -> int:
    """Complete lines in path (0 when it does not exist yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    return text.count("\n")


def test_agent_programs_train_through_the_endpoint_and_stop_mid_rollout(tmp_path):
    out = tmp_path / "run"
    tasks = tmp_path / "tasks.jsonl"
    # ``hold`` holds once iteration 1's samples are written (the end of its TRAIN step, before
    # its metrics line): from iteration 2's rollout on, never in iterations 0 and 1
    hold_when = out / "samples" / "iter_000001.jsonl"
    late_log = tmp_path / "late.jsonl"
    tasks.write_text("".join(json.dumps({"kind": k, "prompt": "say hi", "max_turns": MAX_TURNS,
                                         "hold_when": str(hold_when),
                                         "samples_dir": str(out / "samples"),
                                         "late_log": str(late_log)})
                             + "\n" for k in KINDS))
    args = ["model.vocab_size=128", "rollout.tokenizer=ascii", "env=agent",
            "env.kwargs.entry=earl_megatron.testing.agents:probe", f"env.kwargs.tasks={tasks}",
            "env.kwargs.reward=earl_megatron.testing.agents:score",
            "layout=static", "layout.rollout=tp2", "layout.train=dp2",
            "layout.logprob=dp2", f"rollout.episodes_per_iteration={len(KINDS)}",
            f"rollout.max_turns={MAX_TURNS}", "rollout.max_action_tokens=6",
            "rollout.max_context_tokens=256", "rollout.agent_timeout_s=10",
            "algorithm.micro_batch_size=2", "algorithm.old_logprobs=recompute",
            # iteration 2 is the one the stop abandons
            "run.iterations=3", "run.checkpoint_every=0",
            # the start evaluation plays one task: seed 10**9 % 8 = 0, plain (the stop skips
            # the end evaluation)
            "run.eval_every=0", "run.eval_episodes=1", "run.live_view=false",
            "run.samples_per_iteration=100",
            f"run.output_dir={out}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("EARL_STOP_FILE", None)
    proc = subprocess.Popen([sys.executable, "-m", "earl_megatron.cli", "train",
                             "--nproc-per-node", "2", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 500
        while _lines(out / "metrics.jsonl") < 2:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no metrics line for iteration 1 within 500 s"
            time.sleep(0.05)
        # iteration 2's rollout: its ``hold`` agent never returns, the stop lands in it
        (out / "stop").write_text("requested\n")
        log = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log[-3000:]
    assert (out / "stop").read_text() == "stopped 1\n", log[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000001"
    assert not (out / "samples" / "iter_000002.jsonl").exists()    # abandoned untrained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    for r in records:
        m = r.get("metrics", r)
        assert m["agent_errors"] == 1 and m["agent_timeouts"] == 2, m   # hang, late
        assert m["agent_forks"] == MAX_TURNS - 1 + 1, m     # refusals' resends, the fork
        # re-scored (old_logprobs=recompute): the rows' logprobs are the engine's, forks too
        assert m["rollout_logprob_diff_max"] < 1e-4, m
        # plain 1, refusals MAX_TURNS, fork 2, post 1, late 1, builtin 1, hold (plain here) 1
        assert m["agent_calls_per_episode"] == (1 + MAX_TURNS + 2 + 1 + 1 + 1 + 1) / len(KINDS), m
    # the late call of iteration 0, made while iteration 1 played (iteration 1's may have
    # met the run's end, iteration 2's waits on samples never written)
    late = [json.loads(x) for x in late_log.read_text().splitlines()]
    assert late and all(x == [410, "episode_finished"] for x in late), late

    from earl_megatron.agents.chat import ChatRenderer
    from earl_megatron.train import make_tokenizer
    from earl_megatron.config.train import TrainConfig

    cfg = TrainConfig.from_dict(json.loads((out / "resolved.json").read_text()))
    renderer = ChatRenderer(make_tokenizer(cfg))
    for it in (0, 1):
        rows = [json.loads(line) for line in
                (out / "samples" / f"iter_{it:06d}.jsonl").read_text().splitlines()]
        firsts = {r["info"]["task"]["kind"]: r for r in rows if "task" in r["info"]}
        assert set(firsts) == set(KINDS)
        seen = firsts["refusals"]["info"]["seen"]
        assert {k: v[0] for k, v in seen.items()} == SEEN_OK, seen
        assert seen["too_long"][1] == "context_length_exceeded"
        assert seen["max_turns"][1] == "max_turns_exceeded"
        assert seen["over_cap"][1] == "max_tokens_exceeded"
        assert firsts["refusals"]["reward"] == 1.0
        assert firsts["post"]["reward"] == 0.5
        assert firsts["builtin"]["reward"] == 0.25                   # env.kwargs.reward scored it
        assert firsts["builtin"]["info"]["scored_messages"] == 2
        assert firsts["raise"]["finish_reason"] == "error"
        assert "fails on purpose" in firsts["raise"]["info"]["agent_error"]
        assert firsts["hang"]["finish_reason"] == "timeout"
        assert firsts["hold"]["reward"] == 1.0       # before iteration 2 it plays plain
        assert firsts["late"]["finish_reason"] == "timeout"
        assert firsts["late"]["info"].get("agent_forks", 0) == 0
        for lost in ("raise", "hang", "late"):
            assert firsts[lost]["policy_tokens"] == 0      # a lost episode trains nothing
        # the refusals agent resends its first messages: each call after the first forks
        assert firsts["refusals"]["info"]["agent_forks"] == MAX_TURNS - 1
        assert firsts["fork"]["info"]["agent_forks"] == 1
        assert len(rows) == len(KINDS) + sum(f["info"]["agent_forks"] for f in firsts.values())
        forks = [r for r in rows if r["info"].get("fork") and
                 r["sample"] % len(KINDS) == firsts["fork"]["sample"]]
        assert [f["info"]["fork_reason"] for f in forks] == ["history edited at message 1"], forks
        for r in rows:   # token-in/token-out: each row is its messages' template text
            if r["info"].get("messages"):
                want = renderer.messages_text(r["info"]["messages"], None, False)
                assert want.startswith(r["text"]), (r["text"], want)

    # the trained policy, served from the trainer's own checkpoint (with the run's tokenizer)
    from openai import OpenAI

    proc, url = serve_process(f"run.init={out / 'checkpoints' / 'iter_000001'}",
                              "rollout.tokenizer=ascii", f"run.output_dir={tmp_path / 'serve'}")
    try:
        reply = OpenAI(base_url=url, api_key="test-key", max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "say hi"}], temperature=0,
            max_tokens=8)
        assert reply.choices[0].model_extra["token_ids"]
    finally:
        proc.kill()
