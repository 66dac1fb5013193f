"""Convert a Megatron-Core checkpoint (converted or a training run's) back to Hugging Face.

    python tools/convert_mcore_to_hf.py /ckpt/qwen2.5-7b-mcore /models/qwen2.5-7b-trained

Writes config.json (the source config with the model fields updated), safetensors shards of at
most ``--shard-mb`` with model.safetensors.index.json (one model.safetensors when it fits), and
copies tokenizer files from the checkpoint's hf/ folder or ``--tokenizer-from``. The result
loads with ``transformers.AutoModelForCausalLM.from_pretrained``. Runs in one process on CPU.

A LoRA checkpoint (model.lora.rank > 0) becomes a PEFT adapter: adapter_model.safetensors and
adapter_config.json (HF module names; ``peft.PeftModel.from_pretrained(base, OUT)`` loads it
onto the original HF model) plus the tokenizer files; ``--merged`` writes the full HF model
with the adapters merged instead (docs/lora.md). ``--critic`` exports a PPO run's critic (the
checkpoint's critic/) as a token-classification model whose one label is the value
(``AutoModelForTokenClassification``; docs/algorithms.md).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # conversion is CPU work; hide GPUs before torch loads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt_dir", help="checkpoint written by convert_hf_to_mcore.py")
    p.add_argument("out_dir", help="new (or empty) HF output directory")
    p.add_argument("--part-mb", type=float, default=256.0,
                   help="tensors read from the checkpoint at a time (default 256)")
    p.add_argument("--shard-mb", type=float, default=2048.0,
                   help="largest safetensors shard (default 2048)")
    p.add_argument("--tokenizer-from", default=None,
                   help="copy tokenizer files from this directory instead of the checkpoint's hf/")
    p.add_argument("--merged", action="store_true",
                   help="LoRA checkpoint: write the full HF model with W + (alpha/r) B A merged "
                        "instead of a PEFT adapter")
    p.add_argument("--base-model", default=None,
                   help="LoRA checkpoint: the adapter_config.json's base_model_name_or_path "
                        "(default: the run's run.init, when it is an HF model)")
    p.add_argument("--critic", action="store_true",
                   help="PPO checkpoint: export its critic (critic/) as a token-classification "
                        "model with one label, the value, instead of the policy")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    from earl_megatron.quiet import quiet_known_warnings
    quiet_known_warnings()  # before Megatron's imports print them
    from earl_megatron.weights.convert import convert_mcore_to_hf
    from earl_megatron.weights.critic_export import convert_critic_to_hf
    from earl_megatron.runtime.io_errors import run_tool

    def convert() -> int:
        if not args.no_progress:  # the model's template is built before the first byte moves
            print(f"Megatron-Core -> HF: {args.ckpt_dir} -> {args.out_dir}: "
                  "checking the model against Megatron-Core's keys and shapes", flush=True)
        common = dict(part_bytes=int(args.part_mb * 2**20),
                      max_shard_bytes=int(args.shard_mb * 2**20),
                      tokenizer_from=args.tokenizer_from, progress=not args.no_progress)
        if args.critic:
            if args.merged or args.base_model:
                raise ValueError("--critic exports the value model, which has no adapters: "
                                 "drop --merged / --base-model")
            stats = convert_critic_to_hf(args.ckpt_dir, args.out_dir, **common)
        else:
            stats = convert_mcore_to_hf(args.ckpt_dir, args.out_dir, merged=args.merged,
                                        base_model=args.base_model, **common)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"wrote {args.out_dir}: {stats.tensors} tensors, {stats.bytes / 1e6:.1f} MB in "
              f"{stats.seconds:.1f} s ({stats.mb_per_s:.1f} MB/s), peak RSS {rss:.0f} MiB")
        return 0

    return run_tool(convert)


if __name__ == "__main__":
    sys.exit(main())
