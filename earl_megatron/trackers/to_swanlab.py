"""SwanLab: offline by default, the run's store file under <output_dir>/swanlog/run-*/
(``swanlab sync <that folder>`` uploads it later; SwanLab's "local" mode would also need its
dashboard package). A user who sets ``SWANLAB_MODE``, ``SWANLAB_API_KEY`` or
``SWANLAB_LOG_DIR`` gets SwanLab's own behaviour; ``SWANLAB_PROJECT`` names the project
(default "earl_megatron").

The configuration is the run's config. SwanLab's console capture is off (it would copy the
live display) and its own console lines are kept off the live display. The run's id is kept in
<output_dir>/trackers/swanlab_run_id: a resumed segment continues the same run.
"""

from __future__ import annotations

import contextlib
import io
import os

from earl_megatron.trackers import PROJECT, Tracker, configured_by_env


class SwanlabTracker(Tracker):
    name = "swanlab"

    def start(self, config: dict) -> str:
        import swanlab

        id_file = self.out_dir / "trackers" / "swanlab_run_id"
        run_id = id_file.read_text().strip() if self.start_iteration and id_file.is_file() \
            else None
        kwargs = {} if configured_by_env("swanlab") else \
            {"mode": "offline", "log_dir": str((self.out_dir / "swanlog").resolve())}
        if run_id is not None:
            kwargs.update(id=run_id, resume="allow")
        settings = swanlab.Settings(terminal={"proxy_type": "none"})
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            self.run = swanlab.init(project=os.environ.get("SWANLAB_PROJECT", PROJECT),
                                    name=self.run_name, config=config, settings=settings,
                                    reinit=True, **kwargs)
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run.id)
        return f"run {self.run.id} ({kwargs.get('mode', 'as configured')}) in {self.run.dir}"

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            self.run.finish()


ADAPTER = SwanlabTracker
