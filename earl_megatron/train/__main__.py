"""``python -m earl_megatron.train`` (torchrun's worker): the trainer's ``main``.

Why a package with a ``__main__`` module: a process started by multiprocessing's spawn method
imports its parent's main module again, unless that module is a package's ``__main__``. With
the trainer module as the main module such a child imported torch and the trainer first, 1.5-5.4
s of a core per rank on the 2-core host against 0.10-0.15 s from here (measured 2026-12-06, on
the ``Manager`` Megatron-Core's checkpoint writer started; runtime/checkpoint.save_sharded now
keeps it from starting at all). The trainer itself is the package (``earl_megatron/train/__init__``).
"""

from earl_megatron.train import main

main()
