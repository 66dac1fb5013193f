"""Suite-wide settings: one intra-op thread (tiny models on a loaded 2-core machine run up to 50x
slower with torch's default thread pool), offline Hugging Face hub, property tests without
per-example deadlines."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

# Property tests check values, never speed: no per-example deadline and no "too slow" health
# check (hypothesis' defaults, 200 ms an example, fail on a loaded machine that passes idle)
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("any_speed", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("any_speed")
