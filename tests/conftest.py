"""Suite-wide settings: one intra-op thread (tiny models on a loaded 2-core machine run up to 50x
slower with torch's default thread pool), offline Hugging Face hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
