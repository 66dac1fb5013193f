"""Chat trajectories: the JSONL reader (format rules and their errors), expert traces, tokens
that equal the chat template applied to the whole conversation with the agent-only loss mask, and
the supervised stage's pure parts (batches per step, config checks)."""

import json
from pathlib import Path

import pytest

from earl_megatron.config.sft import SFTConfig
from earl_megatron.envs.tool_env import CalculatorEnv
from earl_megatron.rollout.tokenizer import tool_tokenizer
from earl_megatron.rollout.trajectories import (Trajectory, TrajectoryFormatError,
                                                expert_trajectories, read_jsonl,
                                                trajectory_tokens, write_jsonl)
from earl_megatron.trainer.sft import sample_tensors, step_batch, tokenize_traces

TRACES = Path(__file__).resolve().parents[1] / "data" / "calculator_traces.jsonl"


def _line(*msgs, **extra):
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in msgs], **extra})


def test_reads_the_fixed_trace_file():
    traces = read_jsonl(TRACES)
    assert len(traces) == 32
    assert traces[0].messages[0] == ("user", "compute 51+99-55")
    assert traces[0].meta["seed"] == 0 and traces[0].meta["reward"] == 1.0
    # the file is what the expert plays on seeds 0..31 (regenerate it if the expert changes)
    assert traces == expert_trajectories(lambda: CalculatorEnv(system_prompt=""), range(32))


def test_write_read_round_trip(tmp_path):
    t = Trajectory((("system", "sys"), ("user", "q"), ("assistant", "a1"), ("user", "o"),
                    ("assistant", "a2")), {"seed": 3})
    assert read_jsonl(write_jsonl(tmp_path / "t.jsonl", [t, t])) == [t, t]
    assert (t.system, t.turns[0]) == ("sys", ("user", "q"))


@pytest.mark.parametrize("line, why", [
    ("not json", "not JSON"),
    (json.dumps({"turns": []}), "\"messages\" list"),
    (_line(("user", "q")), "end with an assistant turn"),
    (_line(("assistant", "a")), "turn 0 is 'assistant' where 'user' belongs"),
    (_line(("user", "q"), ("assistant", "a"), ("user", "o")), "end with an assistant turn"),
    (_line(("user", "q"), ("user", "q2"), ("assistant", "a")), "turn 1 is 'user'"),
    (_line(("user", "q"), ("system", "s"), ("assistant", "a")), "turn 1 is 'system'"),
    (_line(("user", "q"), ("robot", "a")), "each message is a role"),
    (json.dumps({"messages": [{"role": "user", "content": 3},
                              {"role": "assistant", "content": "a"}]}), "string content"),
    (json.dumps({"messages": [{"role": "user", "text": "q"}]}), "must be {\"role\""),
])
def test_bad_lines_name_the_file_line_and_problem(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text(_line(("user", "q"), ("assistant", "a")) + "\n\n" + line + "\n")
    with pytest.raises(TrajectoryFormatError, match=f"bad.jsonl:3: .*{why}"):
        read_jsonl(path)


def test_missing_or_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="sft.data"):
        read_jsonl(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TrajectoryFormatError, match="no trajectories"):
        read_jsonl(tmp_path / "empty.jsonl")


def test_tokens_equal_the_template_and_mask_only_the_agent():
    tok = tool_tokenizer()
    t = Trajectory((("system", "calc"), ("user", "compute 2*3"), ("assistant", "<calc>2*3</calc>"),
                    ("user", "<result>6</result>"), ("assistant", "<answer>6</answer>")))
    ids, mask = trajectory_tokens(t, tok)
    whole = tok.apply_chat_template([{"role": r, "content": c} for r, c in t.messages],
                                    tokenize=False)
    assert tok.decode(ids) == whole
    agent = "".join(tok.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m]))
    assert agent == "<calc>2*3</calc><|end|><answer>6</answer><|end|>"
    assert len(ids) == len(mask) and mask[-1] == 1


def test_tokenize_traces_checks_length():
    traces = read_jsonl(TRACES)
    samples = tokenize_traces(traces, tool_tokenizer(), 4096)
    assert max(len(i) for i, _ in samples) <= 64
    with pytest.raises(ValueError, match="trace 0 has .* tokens, more than the model's 10"):
        tokenize_traces(traces, tool_tokenizer(), 10)


def test_step_batches_cover_each_epoch_once_and_are_pure():
    n, b = 10, 4
    epochs = [[i for s in (2 * e, 2 * e + 1) for i in step_batch(n, b, 7, s)] for e in range(3)]
    assert all(len(set(e)) == 8 for e in epochs)  # 2 steps of 4 per epoch, 2 traces wait
    assert set().union(*map(set, epochs)) == set(range(10))
    assert step_batch(n, b, 7, 3) == step_batch(n, b, 7, 3)
    assert step_batch(n, b, 7, 0) != step_batch(n, b, 8, 0)
    assert all(len(set(step_batch(n, b, 7, s))) == b for s in range(20))
    with pytest.raises(ValueError, match="sft.batch_size"):
        step_batch(3, 4, 0, 0)


def test_sample_tensors_are_label_aligned():
    t = sample_tensors([2, 5, 9, 7], [0, 0, 1, 1], 8, pad_id=0)
    assert t["input_ids"].tolist() == [2, 5, 9, 7, 0, 0, 0, 0]
    assert t["labels"].tolist() == [5, 9, 7, 0, 0, 0, 0, 0]
    assert t["loss_mask"].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("kwargs, why", [({"steps": -1}, "sft.steps"),
                                         ({"batch_size": 0}, "sft.batch_size"),
                                         ({"lr": 0.0}, "sft.lr"),
                                         ({"log_every": 0}, "sft.log_every"),
                                         ({"steps": 5, "batch_size": 64, "expert_episodes": 32},
                                          "cannot draw more traces")])
def test_sft_config_range_checks(kwargs, why):
    with pytest.raises(ValueError, match=why):
        SFTConfig(**kwargs)
