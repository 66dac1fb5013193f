"""trainer/samples.py: the decoded episodes written each iteration, and the live view's sample."""

import io

import pytest

from earl_megatron.rollout.agent_loop import Episode
from earl_megatron.rollout.tokenizer import tool_tokenizer
from earl_megatron.trainer.live import LiveView, sample_lines
from earl_megatron.trainer.samples import (
    SampleWriter,
    pick,
    read_samples,
    sample_file,
    segments,
)


def _episode(tok, seed=7, answer="<answer>391</answer>"):
    prompt = tok.apply_chat_template([{"role": "user", "content": "compute 17*23"}],
                                     add_generation_prompt=True, tokenize=False)
    tool = "\n<|user|>\n<result>391</result><|end|>\n<|assistant|>\n"
    pieces = [(prompt, 0), ("<calc>17*23</calc><|end|>", 1), (tool, 0), (answer + "<|end|>", 1)]
    ids, mask = [], []
    for text, m in pieces:
        got = tok.encode(text, add_special_tokens=False)
        ids += got
        mask += [m] * len(got)
    return Episode(env="calculator", seed=seed, token_ids=tuple(ids), loss_mask=tuple(mask),
                   logprobs=tuple(-0.5 * m for m in mask), reward=1.0, turns=2,
                   finish_reason="done", prompt_length=mask.index(1),
                   actions=("<calc>17*23</calc>", answer),
                   observations=("compute 17*23", "<result>391</result>"),
                   info={"correct": True, "tool_calls": 1, "tool_error": False},
                   turn_rewards=(0.0, 1.0)), "".join(t for t, _ in pieces)


def test_pick_spreads_over_the_ids():
    assert pick([5, 1, 3, 7], 2) == [1, 5]
    assert pick(range(8), 4) == [0, 2, 4, 6]
    assert pick([3, 1], 5) == [1, 3] and pick([1, 2], 0) == [] and pick([], 3) == []


def test_segments_cut_where_the_loss_mask_changes():
    assert segments([1, 2, 3, 4, 5], [0, 0, 1, 1, 0]) == [(False, [1, 2]), (True, [3, 4]),
                                                          (False, [5])]


def test_samples_file_holds_the_conversation_as_the_model_saw_it(tmp_path):
    tok = tool_tokenizer()
    eps = [_episode(tok, seed=s) for s in range(5)]
    shown = []

    class View:
        def sample(self, row):
            shown.append(row)

    w = SampleWriter(tmp_path, 2, tok, View())
    f = w.write(3, [10, 11, 12, 13, 14], [e for e, _ in eps])
    assert f == sample_file(tmp_path, 3) == tmp_path / "samples" / "iter_000003.jsonl"
    rows = read_samples(tmp_path, 3)
    assert [r["sample"] for r in rows] == [10, 12] and [r["seed"] for r in rows] == [0, 2]
    r = rows[0]
    text = eps[0][1]
    assert r["text"] == text and "".join(s["text"] for s in r["segments"]) == text
    assert [s["trained"] for s in r["segments"]] == [False, True, False, True]
    assert r["segments"][1]["text"] == "<calc>17*23</calc><|end|>"
    assert r["segments"][3]["text"] == "<answer>391</answer><|end|>"
    assert (r["iteration"], r["reward"], r["turn_rewards"], r["finish_reason"], r["turns"]) == (
        3, 1.0, [0.0, 1.0], "done", 2)
    assert r["info"] == {"correct": True, "tool_calls": 1, "tool_error": False}
    assert r["tokens"] == len(eps[0][0].token_ids)
    assert r["turn_versions"] == [3, 3]   # no versions recorded: the iteration's own

    assert r["policy_tokens"] == sum(eps[0][0].loss_mask)
    assert shown == [rows[-1]]
    # a replayed iteration (resume) replaces its file: never a sample twice
    w.write(3, [10, 11], [eps[0][0], eps[1][0]])
    assert [r["sample"] for r in read_samples(tmp_path, 3)] == [10, 11]
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["iter_000003.jsonl"]
    # off: 0 per iteration, or a rank other than 0
    SampleWriter(tmp_path / "off", 0, tok).write(0, [1], [eps[0][0]])
    SampleWriter(tmp_path / "r1", 2, tok, enabled=False).write(0, [1], [eps[0][0]])
    assert not (tmp_path / "off").exists() and not (tmp_path / "r1").exists()


def test_each_turn_shows_the_version_that_sampled_it(tmp_path):
    import dataclasses

    tok = tool_tokenizer()
    e, _ = _episode(tok, seed=0)
    # a carried episode: its first turn sampled by version 2, its second by version 3
    first = e.loss_mask.index(1)
    second = first + e.loss_mask[first:].index(0) + e.loss_mask[first:][
        e.loss_mask[first:].index(0):].index(1)
    versions = [(-1 if not m else 2 if i < second else 3) for i, m in enumerate(e.loss_mask)]
    SampleWriter(tmp_path, 1, tok).write(3, [0], [dataclasses.replace(e, versions=tuple(versions))])
    r, = read_samples(tmp_path, 3)
    assert r["turn_versions"] == [2, 3]
    assert [s.get("version") for s in r["segments"]] == [None, 2, None, 3]

def test_live_view_shows_the_end_of_the_latest_sample():
    row = {"iteration": 4, "sample": 2, "reward": -1.0, "finish_reason": "done", "turns": 1,
           "info": {"unparsable": True, "tool_error": False},
           "text": "\n".join(f"line {i} " + "x" * i for i in range(20))}
    lines = sample_lines(row, width=16, lines=3)
    assert lines[0] == "sample 2 of i..."
    assert lines[1:] == ["...", "line 17 xxxxx...", "line 18 xxxxx...", "line 19 xxxxx..."]
    assert sample_lines(row, width=200)[0] == ("sample 2 of iteration 4: reward -1.000, done, "
                                                "1 turns, unparsable")
    # on a terminal the rich display renders it under the table; off one nothing is printed
    from rich.console import Console
    out = io.StringIO()
    view = LiveView(10, console=Console(file=out, force_terminal=True, width=120))
    with view:
        view.sample(row)
    assert "reward -1.000, done, 1 turns, unparsable" in out.getvalue()
    assert "line 19" in out.getvalue() and "line 3 " not in out.getvalue()
    plain = io.StringIO()
    with LiveView(10, console=Console(file=plain, force_terminal=False)) as view:
        view.sample(row)
    assert plain.getvalue() == ""


def test_every_replica_leader_writes_its_own_file(tmp_path):
    """run.samples_all_replicas: each leader writes iter_N.r<replica>.jsonl of its own block,
    the other ranks of its replica nothing; replica 0's writer removes what a resume with the
    other setting or more replicas left, so no sample is ever in two files."""
    tok = tool_tokenizer()
    eps = [_episode(tok, seed=s)[0] for s in range(4)]
    SampleWriter(tmp_path, 1, tok).write(2, [0, 1], eps[:2])            # rank 0 alone, earlier
    w = SampleWriter(tmp_path, 2, tok, all_replicas=True)
    for d in range(3):   # a layout of three replicas, before a resume on two
        w.write(2, [10 * d, 10 * d + 1], eps[:2], (d, 3, True))
    assert w.write(2, [0, 1], eps[:2], (0, 2, False)) is None          # not the leader
    w.write(2, [20, 21], eps[2:], (1, 2, True))
    w.write(2, [0, 1], eps[:2], (0, 2, True))
    names = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert names == ["iter_000002.r0.jsonl", "iter_000002.r1.jsonl"]
    assert [r["sample"] for r in read_samples(tmp_path, 2, 1)] == [20, 21]
    assert [r["seed"] for r in read_samples(tmp_path, 2, 1)] == [2, 3]
    # back to rank 0 alone: its write removes the replica files of that iteration
    SampleWriter(tmp_path, 1, tok).write(2, [0, 1], eps[:2], (0, 2, True))
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["iter_000002.jsonl"]
    with pytest.raises(ValueError, match="needs replica"):
        w.write(3, [0], eps[:1])
