"""SGLang's LoRA on a host without a GPU: pinned host memory becomes ordinary memory.

SGLang 0.5.23's LoRA code (sglang/srt/lora: layers, lora, the torch_native backend) pins the
host buffers it stages for the GPU (``pin_memory=True``, ``.pin_memory()``) without asking
whether a GPU exists, and the CUDA build of torch that SGLang pins raises "Found no NVIDIA
driver" there. Pinning only speeds up host-to-GPU copies, so on a CPU server it means nothing.

Installed by tools/sglang_cpu/setup.sh into the CPU kit's venv only, with a .pth line that
imports this module when EARL_SGLANG_CPU_PINNING=off (rollout/sglang_launch.py sets it for CPU
servers that serve LoRA adapters): torch's factory functions then drop ``pin_memory`` and
``Tensor.pin_memory`` returns the tensor itself. Nothing changes when a GPU is present, when the
variable is unset, or in any other venv.
"""

import functools
import os

if os.environ.get("EARL_SGLANG_CPU_PINNING") == "off":
    import torch

    if not torch.cuda.is_available():
        def _unpinned(factory):
            @functools.wraps(factory)
            def make(*args, pin_memory=False, **kwargs):
                return factory(*args, **kwargs)
            return make

        for _name in ("tensor", "as_tensor", "empty", "empty_strided", "zeros", "ones", "full",
                      "arange"):
            setattr(torch, _name, _unpinned(getattr(torch, _name)))
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
