"""``hedged_infer``'s AsyncResult: ``.get()`` never waits past the race's deadline.

Celery's Redis result backend delivers a result by pub/sub, and pub/sub is fire-and-forget: a
result published while the caller's connection is down (a Redis restart, a dropped link) or
between its re-read and its re-subscribe is never delivered, and ``.get()`` without a timeout
then waits for ever. A race whose state was lost (Redis restarted without persistence) never
publishes anything at all. :class:`RaceResult` waits in slices of :data:`RECHECK_S`: each slice
re-reads the stored result first (Celery does that on every ``get``), and between slices it reads
the race's deadline (one ``HGET``). Past the deadline plus :data:`GRACE_S` it raises
:class:`~gpuhedge_celery.errors.RaceFailed` naming what happened (with the receipt when there is
one), unless the caller gave a shorter ``timeout`` (then Celery's ``TimeoutError``, as usual).

``hedged_infer.delay()`` / ``apply_async()`` return one; for an id from ``send_task``, wrap it:
``RaceResult(task_id)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult

from ..errors import GpuHedgeError, RaceFailed

RECHECK_S = 2.0  # how often a waiting caller re-reads the stored result and the deadline
GRACE_S = 10.0  # after the deadline, the workers' own explicit failure has this long to land


def get_in_slices(
    fetch: Callable[[float], Any],
    timeout: float | None,
    slice_s: float,
    between: Callable[[], None],
) -> Any:
    """``fetch(seconds)`` (an ``AsyncResult.get`` that raises Celery's TimeoutError) in slices
    of at most ``slice_s`` until ``timeout`` (None: no end), calling ``between()`` after each
    slice that timed out; it may raise to end the wait with an explicit error."""
    bound = None if timeout is None else time.monotonic() + timeout
    while True:
        wait_s = slice_s if bound is None else max(0.0, min(slice_s, bound - time.monotonic()))
        try:
            return fetch(wait_s)
        except CeleryTimeout:
            if bound is not None and time.monotonic() >= bound:
                raise
        between()


class RaceResult(AsyncResult):
    """An AsyncResult for a hedged race; see the module docstring."""

    def __init__(self, id: str, *args: Any, **kwargs: Any) -> None:  # noqa: A002 - Celery's name
        if "app" not in kwargs and not (args and args[0] is not None):
            from .app import app

            kwargs["app"] = app
        super().__init__(id, *args, **kwargs)
        self._known_at = time.time()  # the earliest this caller could have sent it
        self._deadline: float | None = None

    def get(
        self,
        timeout: float | None = None,
        propagate: bool = True,
        interval: float = 0.5,
        **kwargs: Any,
    ) -> Any:
        def fetch(slice_s: float) -> Any:
            return super(RaceResult, self).get(
                timeout=slice_s, propagate=propagate, interval=interval, **kwargs
            )

        return self._inline(get_in_slices(fetch, timeout, RECHECK_S, self._check_deadline))

    def stop(self, by: str = "caller", wait_s: float = 10.0) -> Any:
        """Stop this race (see :func:`gpuhedge_celery.cancel_race`): ``.get()`` raises
        ``RaceFailed`` (reason ``stopped``), its jobs are cancelled, nothing launches any more.
        A race not created yet (its task still queued) is revoked instead, so it never starts
        (outcome ``revoked``). Returns the :class:`~gpuhedge_celery.race.stop.StopAnswer`."""
        from ..race.stop import REVOKED, UNKNOWN, StopAnswer
        from .stop import cancel_race

        answer = cancel_race(self.id, by, wait_s=wait_s, app=self.app)
        if answer.outcome != UNKNOWN:
            return answer
        # Queued still: a revoked message never runs, and a worker creating the race right
        # now stops it once created (tasks/revokes.py).
        self.revoke()
        return StopAnswer(self.id, REVOKED, "revoke")

    def _inline(self, result: Any) -> Any:
        """The payload inline, whatever result backend this app has: workers store a race's
        payload once and put a reference in the Celery result, which gpuhedge's own backend
        resolves (``tasks/race_backend.py``) but an existing app's plain backend does not."""
        from ..race.receipt import PAYLOAD_INLINE, with_payload

        if not (isinstance(result, dict) and result.get(PAYLOAD_INLINE) is True):
            return result
        try:
            return with_payload(result, payload_client(self.app))
        except Exception:  # noqa: BLE001 - Redis away: the reference, which load_payload reads
            return result

    def _check_deadline(self) -> None:
        """Raise RaceFailed once the race is past its deadline plus the grace."""
        settings = _settings(self.app)
        try:
            store = _store(settings.redis_url, settings.prefix)
            found = store.deadline(self.id)
        except GpuHedgeError:
            return  # Redis unreachable: nothing can be decided now; the next slice looks again
        if found is not None:
            self._deadline = found
        elif self._deadline is None:
            bound = longest_deadline_s(settings.config_path)
            if bound is None:
                return
            # The race never showed up (still queued, or lost with Redis's data): the longest
            # deadline any race of this config can have, counted from when the caller knew it.
            self._deadline = self._known_at + bound
        if time.time() < self._deadline + GRACE_S:
            return
        try:
            receipt = store.receipt(self.id) or {}
        except GpuHedgeError:
            receipt = {}
        if found is None:
            why = (
                "it has no state in Redis (lost in a Redis restart without persistence, "
                "or never started)"
            )
        else:
            why = "no result was delivered"
        raise RaceFailed(
            f"race {self.id}: {why} {GRACE_S:g} s after its deadline; see its receipt", receipt
        )


def _settings(app: Any) -> Any:
    """The gpuhedge settings of the app this result belongs to (else the environment's)."""
    config = getattr(app, "gpuhedge_config", None)
    if config is not None:
        return config.settings
    from .. import settings

    return settings.current().core


def payload_client(app: Any) -> Any:
    """The race store's Redis, which holds a referenced payload: the Redis of Celery's results
    too, unless the store is a Redis Cluster (its results are then on the broker's Redis)."""
    from ..store.connection import client_for

    return client_for(_settings(app).redis_url)


@lru_cache(maxsize=16)
def _store(redis_url: str, prefix: str) -> Any:
    from .. import settings
    from ..store.connection import client_for
    from ..store.races import RaceStore

    shards = settings.current().race_shards(prefix, redis_url)
    return RaceStore(client_for(redis_url), shards)


@lru_cache(maxsize=4)
def longest_deadline_s(config_path: Any) -> float | None:
    """Real seconds: the longest deadline a race of the config at ``config_path`` can have
    (None when it cannot be loaded here): ``timeouts.race_deadline_s``, else the three longest
    caps added up plus the slack (a policy races at most three providers)."""
    from ..config import RACE_SLACK_S, load_config

    try:
        cfg = load_config(config_path)
    except GpuHedgeError:
        return None
    if cfg.race_deadline_s is not None:
        provider_s = cfg.race_deadline_s
    else:
        caps = sorted((cfg.cap_s(name) for name in cfg.providers), reverse=True)
        provider_s = sum(caps[:3]) + RACE_SLACK_S
    return provider_s * cfg.time_scale
