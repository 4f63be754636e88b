"""``AsyncResult.revoke()`` on a ``hedged_infer`` result stops its race.

``hedged_infer`` returns as soon as its race is created; the race runs on as state in Redis.
Celery's revoke is a broadcast: every worker adds the id to its in-memory revoked set
(``celery.worker.state.revoked``), and a worker not running the task marks it ``REVOKED`` in
the result backend unless a result is stored, so the caller's ``.get()`` raises
``TaskRevokedError`` at once. Alone, that left the race launching and billing. Celery sends no
signal for it (``task_revoked`` fires only for a task it discards or terminates), so each
coordination worker runs a :class:`RevokeWatch` thread that looks at that set every
:data:`INTERVAL_S` and stops every race among the ids it has not seen yet
(``StopRequested("revoke")``: every worker does, and the stop is idempotent). The race's own
failure does not overwrite a ``REVOKED`` result (``CeleryEffects.failed``); where no worker
marked one (each was running the task: its primary's submit), the caller gets ``RaceFailed``
with reason ``stopped``. A revoke that comes while ``hedged_infer`` is creating the race is
applied by ``hedged_infer`` itself once the race exists.

Revoked ids live in worker memory: a revoke sent while no coordination worker is up reaches
none and stops nothing (unless the workers keep a ``--statedb``, whose ids a starting
worker's watch looks at first), and Celery keeps ids ``CELERY_WORKER_REVOKE_EXPIRES`` (3 h).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..core.race_events import StopRequested
from ..store.timers import store_errors

log = logging.getLogger(__name__)

INTERVAL_S = 0.5  # how often the revoked set is looked at (an in-memory read)
FULL_EVERY_S = 5.0  # and compared whole even when its size did not change (ids that expired
# while as many came in)
BY = "revoke"  # the receipt's stopped_by for a race stopped by Celery's revoke


def stop_revoked(driver: Any, ids: Iterable[str]) -> list[str]:
    """Stop the races among ``ids`` (a round trip per shard to find them); returns the ids
    stopped."""
    store = driver.store
    named: list[str] = []
    for task_id in ids:
        try:
            store.shards.tag_of(task_id)
        except ValueError:  # a revoked task id that can never name a race
            continue
        named.append(task_id)
    if not named:
        return []
    races: set[str] = set()
    with store_errors("looking up revoked races"):
        for group in store.shards.by_shard(named).values():  # one pipeline per shard's slot
            pipe = store.client.pipeline(transaction=False)
            for race_id in group:
                pipe.exists(store.shards.race(race_id).state)
            races.update(r for r, exists in zip(group, pipe.execute(), strict=True) if exists)
    stopped = []
    for race_id in dict.fromkeys(named):
        if race_id in races:
            driver.step(race_id, StopRequested(BY))
            stopped.append(race_id)
    return stopped


class RevokeWatch:
    """A daemon thread that hands every id new in ``revoked`` to ``on_revoked(ids)``."""

    def __init__(
        self,
        on_revoked: Callable[[list[str]], Any],
        revoked: Any = None,
        interval_s: float = INTERVAL_S,
        name: str = "gpuhedge-revokes",
    ) -> None:
        if revoked is None:
            from celery.worker import state as worker_state

            revoked = worker_state.revoked
        self.on_revoked = on_revoked
        self.revoked = revoked
        self.interval_s = interval_s
        self._seen: set[str] = set()
        self._size = -1
        self._compared = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> RevokeWatch:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def new_ids(self) -> list[str]:
        """The ids added to the revoked set since the last look (all of them the first time)."""
        now = time.monotonic()
        size = len(self.revoked)
        if size == self._size and now - self._compared < FULL_EVERY_S:
            return []
        try:
            current = set(self.revoked.as_dict())
        except RuntimeError:  # changed by the control thread while read: look again next time
            return []
        self._size, self._compared = size, now
        new = current - self._seen
        self._seen = current  # bounded as the revoked set is
        return sorted(new)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                ids = self.new_ids()
                if ids:
                    self.on_revoked(ids)
            except Exception:  # Redis away: those ids are looked at again once it answers
                log.warning("revoked races not stopped this time; trying again", exc_info=True)
                self._size = -1
                self._seen = set()
