"""Stopping a race from outside: ``gpuhedge_celery.cancel_race(race_id)``,
``RaceResult.stop()`` and ``gpuhedge-celery cancel``.

The stop is the engine event ``StopRequested(by)``, sent to the coordination workers as a
``gpuhedge.race_step`` task (the way every outside event enters a race): the worker that takes
it loads the race, applies the stop, saves with the version check and only then fails the
caller and cancels every live job through its provider's native cancel (receipts as for any
loser; a hedge not launched yet never launches). This side reads the race first (an unknown,
finished or already stopped race gets its answer without anything sent), sends the event, and
waits up to ``wait_s`` for the stop to show in the race's state.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..core.race_events import StopRequested
from ..names import QUEUE_COORD
from ..race.stop import PENDING, StopAnswer, check_by, read_stop
from .race_runtime import TASK_RACE_STEP

POLL_S = 0.05  # how often a waiting stopper re-reads the race


def _app_and_store(app: Any, redis_url: str | None, prefix: str | None) -> tuple[Any, Any]:
    """The Celery app to send with and the race store to read, on the same Redis and prefix."""
    from ..store.connection import client_for
    from ..store.races import RaceStore

    if app is None:
        from .app import app as default_app
        from .app import create_app
        from .config import GlueConfig

        if redis_url is None and prefix is None:
            app = default_app
        else:
            env = dict(os.environ)
            if redis_url is not None:
                env["GPUHEDGE_REDIS_URL"] = redis_url
            if prefix is not None:
                env["GPUHEDGE_PREFIX"] = prefix
            app = create_app(GlueConfig.from_env(env))
    settings = app.gpuhedge_config.settings if hasattr(app, "gpuhedge_config") else None
    if settings is None:
        from ..settings import Settings

        settings = Settings.from_env(redis_url=redis_url, prefix=prefix)
    from ..settings import current

    shards = current().race_shards(settings.prefix, settings.redis_url)
    return app, RaceStore(client_for(settings.redis_url), shards)


def send_stop(app: Any, store: Any, race_id: str, by: str, wait_s: float) -> StopAnswer:
    """Stop race ``race_id`` in ``store`` through ``app``'s broker; see the module."""
    by = check_by(by)
    found = read_stop(store, race_id)
    if found.outcome:  # unknown, finished or stopped already: nothing is sent
        return found
    app.send_task(
        TASK_RACE_STEP,
        (race_id, StopRequested(by).to_dict()),
        queue=QUEUE_COORD,
        ignore_result=True,
    )
    until = time.monotonic() + max(0.0, wait_s)
    while True:
        found = read_stop(store, race_id, by)
        if found.outcome:
            return found
        if time.monotonic() >= until:
            return StopAnswer(race_id, PENDING)
        time.sleep(POLL_S)


def cancel_race(
    race_id: str,
    by: str = "caller",
    *,
    wait_s: float = 10.0,
    app: Any = None,
    redis_url: str | None = None,
    prefix: str | None = None,
) -> StopAnswer:
    """Stop race ``race_id`` (= its ``hedged_infer`` task id): its caller's ``.get()`` raises
    ``RaceFailed`` (reason ``stopped``), every live job is cancelled natively with a receipt,
    nothing launches any more, and the receipt names ``by`` as who stopped it.

    Returns a :class:`~gpuhedge_celery.race.stop.StopAnswer`: ``outcome`` ``stopped``,
    ``already_stopped`` (idempotent: the first stop holds), ``already_finished`` (won, failed
    or past its deadline: nothing done), ``unknown`` (nothing sent), or ``pending`` (sent; no
    coordination worker applied it within ``wait_s``). ``app``: the Celery app to send with
    (default: gpuhedge's, on ``redis_url`` / ``prefix`` or the environment's).
    """
    app, store = _app_and_store(app, redis_url, prefix)
    from ..store.connection import translate_errors

    with translate_errors():
        return send_stop(app, store, race_id, by, wait_s)
