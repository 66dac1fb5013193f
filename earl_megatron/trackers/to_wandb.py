"""Weights & Biases: offline by default, the run's files under <output_dir>/wandb
(``wandb sync <output_dir>/wandb/offline-run-*`` uploads them later). A user who sets
``WANDB_MODE``, ``WANDB_API_KEY`` or ``WANDB_DIR`` gets wandb's own behaviour (online when
logged in); ``WANDB_PROJECT``/``WANDB_ENTITY`` name the project (default "earl_megatron").

The configuration is the run's config. The run's id is kept in <output_dir>/trackers/wandb_run_id:
a resumed segment continues the same run (wandb drops a step below the run's latest, so replayed
iterations keep their first values).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from earl_megatron.trackers import PROJECT, Tracker, configured_by_env


class WandbTracker(Tracker):
    name = "wandb"

    def start(self, config: dict) -> str:
        import wandb

        id_file = self.out_dir / "trackers" / "wandb_run_id"
        run_id = id_file.read_text().strip() if self.start_iteration and id_file.is_file() \
            else uuid.uuid4().hex[:8]
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id)
        kwargs = {} if configured_by_env("wandb") else \
            {"mode": "offline", "dir": str(self.out_dir)}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT),
                              name=self.run_name, id=run_id, resume="allow", config=config,
                              settings=wandb.Settings(console="off", silent=True),
                              reinit="create_new", **kwargs)
        return f"run {run_id} ({self.run.settings.mode}) in {Path(self.run.dir).parent}"

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


ADAPTER = WandbTracker
