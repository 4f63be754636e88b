"""The beat task ``gpuhedge.janitor``: end races nobody advances and cancel their provider jobs.

Glue only (the rules are in :mod:`gpuhedge_celery.race.janitor`): take a short lock so two passes
never run at once (beat must run as one instance, but a redelivered or manually sent pass may
overlap), build a :class:`~gpuhedge_celery.race.janitor.Janitor` over this worker's race
runtime and run one pass. Even without the lock each race is cleaned under its own ownership
lease and every step is idempotent.

Its settings are ``settings.current().janitor`` (``GPUHEDGE_JANITOR_STALE_S``,
``GPUHEDGE_JANITOR_LIMIT``: docs/configuration.md, *Environment variables*).

Beat schedules it on the reconcile period (``GPUHEDGE_RECONCILE_INTERVAL_S``).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from .. import settings as process_settings
from ..race.janitor import Janitor, JanitorOptions
from ..settings import JanitorSettings
from ..store.keys import Keys
from .app import TASK_JANITOR, app
from .race_runtime import CeleryEffects, runtime

__all__ = ["JanitorSettings", "build_janitor", "janitor", "lock_key"]

log = logging.getLogger(__name__)

LOCK_MS = 20_000
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def lock_key(prefix: str) -> str:
    """The short lock that keeps two janitor passes from running at once."""
    return Keys(prefix).janitor_lock()


def build_janitor(settings: JanitorSettings | None = None) -> Janitor:
    """A janitor over this process's race runtime (its store, timers, providers)."""
    settings = settings or process_settings.current().janitor
    rt = runtime()

    def alive() -> bool:
        # This worker fires race timers itself while its timer thread runs.
        return rt.service is not None and rt.service.alive

    return Janitor(
        rt.store,
        rt.timers,
        rt.provider,
        CeleryEffects(),  # won() skips a result already marked: no link runs twice
        JanitorOptions(
            stale_ms=int(settings.stale_s * 1000),
            receipt_ttl_s=rt.settings.receipt_ttl_s,
            payload_inline_max=rt.settings.payload_inline_max,
            coordinators_alive=alive,
            clock=rt.clock,  # Redis's time, as the races' heartbeats (store/redis_clock.py)
            budget=rt.budget,
        ),
    )


@app.task(name=TASK_JANITOR, acks_late=True, reject_on_worker_lost=True)
def janitor() -> dict[str, Any]:
    """One janitor pass; returns what it did (``{"races": [...], "cancelled", ...}``)."""
    settings = process_settings.current().janitor
    rt = runtime()
    token = uuid.uuid4().hex
    key = lock_key(rt.prefix)
    if not rt.client.set(key, token, nx=True, px=LOCK_MS):
        return {"skipped": "another janitor pass holds the lock"}
    try:
        report = build_janitor(settings).run_once(settings.limit)
    finally:
        rt.client.eval(_RELEASE, 1, key, token)
    if report.races:
        log.info(
            "janitor: %d races looked at, %d jobs cancelled, %d not confirmed",
            len(report.races),
            report.cancelled,
            report.leaked,
        )
    return report.to_dict()
