"""Beat's schedule file: where it goes, and a scheduler that makes its directory.

Celery's beat keeps each periodic task's last run time in a shelve file, by default
``celerybeat-schedule`` (``.db``, or ``.dat``/``.dir``/``.bak``) in whatever directory beat was
started from. The app points it at ``GPUHEDGE_BEAT_SCHEDULE`` instead (``tasks/config.py``), by
default ``$XDG_STATE_HOME/gpuhedge-celery/celerybeat-schedule-<prefix>`` (``~/.local/state``
when ``XDG_STATE_HOME`` is unset), and ``celery beat --schedule FILE`` still wins. Losing the
file is harmless: the reconcile pass and the janitor run every period anyway.
"""

from __future__ import annotations

from pathlib import Path

from celery.beat import PersistentScheduler


class Scheduler(PersistentScheduler):
    """Celery's persistent scheduler, creating the schedule file's directory first."""

    def setup_schedule(self) -> None:
        Path(self.schedule_filename).parent.mkdir(parents=True, exist_ok=True)
        super().setup_schedule()
