"""A worker plugin that loses Redis's answer to chosen race-store calls, once per race: the call
runs, then raises StoreUnavailable, as when a connection is cut after the command arrived.

``GPUHEDGE_TEST_BLIP``: a comma list of ``create`` (``RaceDriver.create``), ``claim_submit``
(``RaceStore.claim_submit_with_request``, an attempt's submit intent) and ``add_job``
(``RaceStore.add_job``, the registration of a job the provider just accepted). Imported through
``GPUHEDGE_PLUGINS`` (tests/test_faults_blips.py).
"""

from __future__ import annotations

import functools
import os
import threading

from gpuhedge_celery.errors import StoreUnavailable
from gpuhedge_celery.race.driver import RaceDriver
from gpuhedge_celery.store.races import RaceStore

CHOSEN = {x.strip() for x in os.environ.get("GPUHEDGE_TEST_BLIP", "").split(",") if x.strip()}
_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def _lose_first_answer(cls: type, name: str) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapped(self, race_id, *args, **kwargs):
        out = original(self, race_id, *args, **kwargs)
        with _lock:
            first = (name, race_id) not in _seen
            _seen.add((name, race_id))
        if first:
            raise StoreUnavailable("Redis is unreachable (Connection closed by server.) [blip]")
        return out

    setattr(cls, name, wrapped)


if "create" in CHOSEN:
    _lose_first_answer(RaceDriver, "create")
if "claim_submit" in CHOSEN:
    _lose_first_answer(RaceStore, "claim_submit_with_request")
if "add_job" in CHOSEN:
    _lose_first_answer(RaceStore, "add_job")
