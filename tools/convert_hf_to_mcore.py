"""Convert a Hugging Face model directory into a Megatron-Core distributed checkpoint.

    python tools/convert_hf_to_mcore.py /models/Qwen2.5-7B-Instruct /ckpt/qwen2.5-7b-mcore

The output loads under ANY layout (dist_checkpointing reshards on load): pass it to the trainer
(``earl_megatron.weights.convert.load_policy``) or convert it back with convert_mcore_to_hf.py.
It holds the ModelConfig (earl_model_config.json) and the source config.json and tokenizer files
(hf/). Runs in one process on CPU; memory stays near ``--part-mb`` plus the largest tensor.
Supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM (per-expert
tensors, as the hub stores them; safetensors, one file or sharded with an index).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # conversion is CPU work; hide GPUs before torch loads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", help="HF directory: config.json + *.safetensors")
    p.add_argument("out_dir", help="new (or empty) output directory")
    p.add_argument("--part-mb", type=float, default=256.0,
                   help="tensors buffered per dist_checkpointing save (default 256)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    from earl_megatron.quiet import quiet_known_warnings
    quiet_known_warnings()  # before Megatron's imports print them
    from earl_megatron.weights.convert import convert_hf_to_mcore
    from earl_megatron.runtime.io_errors import run_tool

    def convert() -> int:
        if not args.no_progress:  # the model's template is built before the first byte moves
            print(f"HF -> Megatron-Core: {args.hf_dir} -> {args.out_dir}: "
                  "checking the model against Megatron-Core's keys and shapes", flush=True)
        stats = convert_hf_to_mcore(args.hf_dir, args.out_dir, part_bytes=int(args.part_mb * 2**20),
                                    progress=not args.no_progress)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"wrote {args.out_dir}: {stats.tensors} tensors, {stats.bytes / 1e6:.1f} MB in "
              f"{stats.seconds:.1f} s ({stats.mb_per_s:.1f} MB/s), {stats.parts} part(s), "
              f"peak RSS {rss:.0f} MiB")
        return 0

    return run_tool(convert)


if __name__ == "__main__":
    sys.exit(main())
