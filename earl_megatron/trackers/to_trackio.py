"""Trackio: its local store (a SQLite file per project) under <output_dir>/trackio, unless the
user's environment sets ``TRACKIO_DIR``, ``TRACKIO_SPACE_ID`` (a Hugging Face Space) or
``TRACKIO_SERVER_URL``; ``TRACKIO_PROJECT`` names the project (default "earl_megatron").
``trackio show --project earl_megatron`` (with the same ``TRACKIO_DIR``) opens its dashboard.

Trackio reads ``TRACKIO_DIR`` once, when it is first imported: the adapter sets it in this
process before that import. Its own console lines are kept off the live display. A resumed
segment continues the run of the same name (the output directory's).
"""

from __future__ import annotations

import contextlib
import io
import os

from earl_megatron.trackers import PROJECT, Tracker, configured_by_env


class TrackioTracker(Tracker):
    name = "trackio"

    def start(self, config: dict) -> str:
        if not configured_by_env("trackio"):
            os.environ["TRACKIO_DIR"] = str((self.out_dir / "trackio").resolve())
        import trackio
        from trackio.utils import TRACKIO_DIR

        project = os.environ.get("TRACKIO_PROJECT", PROJECT)
        with contextlib.redirect_stdout(io.StringIO()):
            self.run = trackio.init(project=project, name=self.run_name, config=config,
                                    resume="allow", space_id=os.environ.get("TRACKIO_SPACE_ID"),
                                    server_url=os.environ.get("TRACKIO_SERVER_URL"),
                                    embed=False)
        where = os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL") \
            or TRACKIO_DIR
        return f"run {self.run_name!r} of project {project!r} in {where}"

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        import trackio

        with contextlib.redirect_stdout(io.StringIO()):
            trackio.finish()     # the module's: its exit hook then has no run left to finish


ADAPTER = TrackioTracker
