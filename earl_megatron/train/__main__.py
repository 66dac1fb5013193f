"""``python -m earl_megatron.train`` (torchrun's worker): the trainer's ``main``.

Why a package with a ``__main__`` module: a process started by multiprocessing's spawn method
imports its parent's main module again, unless that module is a package's ``__main__``.
Megatron-Core's checkpoint writer starts one at every process's first save (a ``Manager`` for
its write results); with the trainer module as the main module that child imported torch and
the trainer first, 1.5-5.4 s of a core per rank on the 2-core host against 0.10-0.15 s from
here (measured 2026-12-06). The trainer itself is the package (``earl_megatron/train/__init__``).
"""

from earl_megatron.train import main

main()
