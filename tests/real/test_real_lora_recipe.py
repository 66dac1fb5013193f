"""recipes/smollm2_tool_lora.yaml on the real model, shortened: LoRA from an HF checkpoint.

One torchrun job of 2 ranks runs the recipe as a user does (``--config-name smollm2_tool_lora``,
``run.init`` the SmolLM2 fixture directory) with a 1-step warm start on the expert's traces and 2
RL iterations. Asserted from the files the run writes:
- the run's model is the checkpoint's with the recipe's adapters (rank 16, alpha 32, all four
  targets) and its records are finite;
- the last checkpoint exported as a PEFT adapter (``earl convert mcore-to-hf``) names run.init
  as its base, and every B (zero at the start) is nonzero: the adapters trained;
- exported ``--merged``: every tensor without an adapter (embeddings, norms) equals SmolLM2's
  bit for bit, and each adapted linear equals SmolLM2's weight plus (alpha / r) B A to float
  rounding: the base did not change.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

SHORT = ["sft.steps=1", "sft.batch_size=4", "sft.expert_episodes=8", "sft.log_every=1",
         "rollout.episodes_per_iteration=4", "run.eval_episodes=2", "run.checkpoint_every=0",
         "run.live_view=false", "run.samples_per_iteration=0", "run.iterations=2"]


def _run(args, timeout=1200):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_lora_recipe_trains_adapters_over_the_frozen_checkpoint(smollm2_dir, scratch_dir,
                                                                record):
    import torch
    from safetensors.torch import load_file

    out = scratch_dir / "lora"
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
          "-m", "earl_megatron.train", "--config-name", "smollm2_tool_lora",
          f"run.init={smollm2_dir}", f"run.output_dir={out}", *SHORT])
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [0, 1]
    for r in recs:
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "reward")), r
    model = json.loads((out / "resolved.json").read_text())["model"]
    assert model["num_layers"] == 30 and model["lora"]["rank"] == 16
    assert model["lora"]["alpha"] == 32.0 and len(model["lora"]["targets"]) == 4
    record("lora recipe: seconds per iteration (rollout, train)",
           ", ".join(f"{recs[1]['seconds'][k]:.1f}" for k in ("rollout", "train")))

    ckpt = out / "checkpoints" / "iter_000001"
    _run(["-m", "earl_megatron.cli", "convert", "mcore-to-hf", str(ckpt), str(out / "peft")])
    conf = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(smollm2_dir)
    assert (conf["r"], conf["lora_alpha"]) == (16, 32.0)
    adapter = load_file(out / "peft" / "adapter_model.safetensors")
    bs = {k: v for k, v in adapter.items() if ".lora_B." in k}
    assert len(bs) == 30 * 7 and all(v.abs().max() > 0 for v in bs.values())

    _run(["-m", "earl_megatron.cli", "convert", "mcore-to-hf", str(ckpt), str(out / "merged"),
          "--merged"])
    hf, merged = {}, {}
    for d, into in ((smollm2_dir, hf), (out / "merged", merged)):
        for f in sorted(d.glob("*.safetensors")):
            into.update(load_file(f))
    assert merged.keys() == hf.keys()
    worst, moved = 0.0, 0.0
    for name, w in hf.items():
        key = "base_model.model." + name.removesuffix(".weight")
        if f"{key}.lora_A.weight" not in adapter:
            assert torch.equal(merged[name], w), name        # no adapter: untouched
            continue
        delta = 2.0 * adapter[f"{key}.lora_B.weight"] @ adapter[f"{key}.lora_A.weight"]
        worst = max(worst, (merged[name] - (w + delta)).abs().max().item())
        moved = max(moved, delta.abs().max().item())
    assert worst < 1e-5 < moved, (worst, moved)
    record("lora recipe: merged - (base + 2 B A), max abs", worst)
    record("lora recipe: largest 2 B A entry after 2 iterations", moved)
