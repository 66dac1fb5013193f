"""RL on the real model through the trainer: recipes/smollm2_tool.yaml, shortened.

One torchrun job of 2 ranks runs the recipe as a user does (``--config-name smollm2_tool``,
``run.init`` the fixture directory: the model config, tokenizer and ChatML template come from it)
with a 1-step warm start on the expert's JSON traces and 1 RL iteration; a second job resumes it
for iteration 2 from the checkpoint. Asserted from the files the runs write:
- the selector's layouts differ between stages (rollout DP2, train CP2 under a 3.5 GiB per-rank
  budget, where DP2's 3.5 GiB train no longer fits): every iteration switches in place;
- the resumed run continued (iterations [0, 1], the first line unchanged, one warm start only);
- samples/ holds decoded episodes in the model's own chat format (system prompt with the tool,
  the question as a user turn, what the policy said as an assistant turn);
- the model config in resolved.json is the checkpoint's (30 layers, 9 heads, 3 KV groups);
- a trainer checkpoint carries the tokenizer and HF config (``hf/``): ``run.init`` it again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SHORT = ["sft.steps=1", "sft.batch_size=4", "sft.expert_episodes=8", "sft.log_every=1",
         "rollout.episodes_per_iteration=4", "run.eval_episodes=2", "run.checkpoint_every=1",
         "run.live_view=false", "run.samples_per_iteration=2",
         "layout.memory_budget_gb=3.5"]   # train DP2 (3.5 GiB) no longer fits: CP2


def _train(out, smollm2_dir, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "earl_megatron.train",
                           "--config-name", "smollm2_tool", f"run.init={smollm2_dir}",
                           f"run.output_dir={out}", *SHORT, *extra],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_rl_iterations_on_the_real_model_switch_layouts_and_resume(smollm2_dir, scratch_dir,
                                                                     record):
    out = scratch_dir / "rl"
    first = _train(out, smollm2_dir, "run.iterations=1")
    both = _train(out, smollm2_dir, "run.iterations=2")
    assert [m["iteration"] for m in both] == [0, 1]
    assert both[0] == first[0]                       # resumed, not rerun
    assert len((out / "sft.jsonl").read_text().splitlines()) == 1   # one warm start step
    for m in both:
        assert m["layouts"]["rollout"] != m["layouts"]["train"], m["layout_reasons"]
        assert m["predicted_memory_gb"]["train"] <= 3.5
        assert m["rollout_engine"] == "embedded" and m["max_context"] > 60
    record("rl: layouts (rollout -> train)",
           f"{both[0]['layouts']['rollout']} -> {both[0]['layouts']['train']}")
    record("rl: seconds per iteration (rollout, train, switch)",
           ", ".join(f"{both[1]['seconds'][k]:.1f}" for k in ("rollout", "train", "switch")))

    model = json.loads((out / "resolved.json").read_text())["model"]
    assert (model["num_layers"], model["num_attention_heads"], model["num_query_groups"],
            model["vocab_size"], model["tie_word_embeddings"]) == (30, 9, 3, 49152, True)

    # the checkpoint carries the run's tokenizer and the HF config it started from: run.init=
    # this checkpoint takes both, and the exporter writes a complete HF directory
    from earl_megatron.train import apply_run_init

    ckpt = out / "checkpoints" / "iter_000001"
    assert json.loads((ckpt / "hf" / "config.json").read_text()) == \
        json.loads((smollm2_dir / "config.json").read_text())
    again = apply_run_init({"run": {"init": str(ckpt)}, "model": {}, "rollout": {}})
    assert again["rollout"]["tokenizer"] == str(ckpt)
    assert again["model"]["num_layers"] == 30

    samples = [json.loads(line) for f in sorted((out / "samples").iterdir())
               for line in f.read_text().splitlines()]
    assert {s["iteration"] for s in samples} == {0, 1}
    for s in samples:
        assert s["text"].startswith("<|im_start|>system\nYou can use a calculator tool.")
        assert "<|im_start|>user\nWhat is " in s["text"]
        assert "<|im_start|>assistant\n" in s["text"]
        trained = "".join(seg["text"] for seg in s["segments"] if seg["trained"])
        assert trained and trained.count("<|im_end|>") <= s["turns"]
        assert "<|im_start|>" not in trained            # no template token is ever trained
