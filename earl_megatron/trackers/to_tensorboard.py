"""TensorBoard: event files under <output_dir>/tensorboard (torch's SummaryWriter).

The configuration is one text entry ("config", the resolved JSON). A resumed segment drops the
events of iterations after its checkpoint (a run killed between its metrics line and its
checkpoint replays them): no step appears twice.
"""

from __future__ import annotations

import json

from earl_megatron.trackers import Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def start(self, config: dict) -> str:
        from torch.utils.tensorboard import SummaryWriter

        path = self.out_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(path), flush_secs=30,
                                    purge_step=self.start_iteration or None)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```",
                             self.start_iteration)
        return f"event files in {path} (tensorboard --logdir {path})"

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def finish(self) -> None:
        self.writer.close()


ADAPTER = TensorBoardTracker
