"""The client's result subscriber: a send to an unreachable Redis fails at once, explicitly.

Before a client publishes a task whose result it may wait for (``hedged_infer.delay()``,
``send_task``), Celery's Redis backend subscribes to the task's result channel. When that
subscribe finds Redis gone, Celery reconnects with the backend's retry policy (20 tries, a
second apart) and then raises ``RuntimeError`` ("The Celery application must be restarted"),
logging each try: a client whose Redis is down waited 20 s for a misleading traceback.

Here a send whose subscribe fails first checks, with one quick connection of its own, whether
Redis answers at all: if it does, Celery's reconnect runs as before (a dropped connection to a
live Redis); if not, the send raises :class:`~gpuhedge_celery.errors.StoreUnavailable` within
:data:`SEND_PROBE_S` seconds and leaves the subscriber as it was, so callers already waiting in
``.get()`` keep Celery's reconnect (with its long retries) through an outage or a restart, and
the next send, once Redis is back, subscribes again. Such a caller's reconnect holds the
subscriber's lock while it retries; a send that waited :data:`LOCK_WAIT_S` for it makes the
same check instead of waiting out those retries. Workers never subscribe (their sends do
not wait for results), so their retries are untouched.

:func:`broker_errors` does the same for the publish itself: a broker that refuses the
connection (Redis, or RabbitMQ) after kombu's publish retries is a ``StoreUnavailable`` naming
it, not kombu's ``OperationalError``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis
from celery.backends.redis import ResultConsumer
from kombu.exceptions import OperationalError
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import StoreUnavailable
from ..shared_settings import redact_url

SEND_PROBE_S = 2.0  # how long a send looks for Redis before it reports it unreachable
LOCK_WAIT_S = 1.0  # a send waits this long for the subscriber before it looks for Redis itself
_PROBE_PAUSE_S = 0.25


class SendingResultConsumer(ResultConsumer):
    """Celery's Redis result consumer; a send (``consume_from``) never waits out its retries."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sending = threading.local()

    def consume_from(self, task_id: str) -> Any:
        lock = self._pubsub_lock
        # A caller waiting in .get() reconnects while holding this lock, for as long as
        # Celery's retries last: a send that finds it busy looks for Redis itself meanwhile.
        held = lock.acquire(timeout=LOCK_WAIT_S)
        try:
            if not held:
                self._raise_if_unreachable()
            self._sending.active = True
            return super().consume_from(task_id)
        except StoreUnavailable:
            # never subscribed: a later reconnect must not subscribe a task that was not sent
            self.subscribed_to.discard(self._get_key_for_task(task_id))
            raise
        finally:
            self._sending.active = False
            if held:
                lock.release()

    def _reconnect(self) -> None:
        if getattr(self._sending, "active", False):
            self._raise_if_unreachable()
        super()._reconnect()

    def _raise_if_unreachable(self) -> None:
        error = self._unreachable()
        if error is not None:
            where = redact_url(str(getattr(self.backend, "url", "") or "")) or "Redis"
            raise StoreUnavailable(
                f"Redis at {where} is unreachable ({error}); nothing was sent; "
                "set GPUHEDGE_REDIS_URL"
            ) from error

    def _unreachable(self) -> Exception | None:
        """None when Redis accepts a connection within :data:`SEND_PROBE_S`, else the error."""
        pool = self.backend.client.connection_pool
        kwargs = dict(pool.connection_kwargs)
        kwargs["retry"] = Retry(NoBackoff(), 0)
        deadline = time.monotonic() + SEND_PROBE_S
        while True:
            left = deadline - time.monotonic()
            kwargs["socket_connect_timeout"] = max(0.1, left)
            conn = pool.connection_class(**kwargs)
            try:
                conn.connect()
                return None
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                if time.monotonic() + _PROBE_PAUSE_S >= deadline:
                    return e
            finally:
                conn.disconnect()
            time.sleep(_PROBE_PAUSE_S)


@contextlib.contextmanager
def broker_errors(app: Any) -> Iterator[None]:
    """Publishing through ``app``: kombu's "cannot reach the broker" as a one-line
    :class:`StoreUnavailable` naming the broker (its password hidden)."""
    try:
        yield
    except OperationalError as e:
        where = redact_url(str(app.conf.broker_url or "")) or "the broker"
        raise StoreUnavailable(
            f"the broker at {where} is unreachable ({e}); nothing was sent; "
            "set GPUHEDGE_REDIS_URL (or GPUHEDGE_BROKER_URL)"
        ) from e
