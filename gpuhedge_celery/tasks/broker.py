"""The Redis broker transport, with one fix for losing Redis while messages are unacknowledged.

kombu's Redis transport closes a channel whose connection was lost by restoring the messages
it had delivered and not yet acknowledged. After the connection is gone that restore reaches
for a connection pool built from ``connection.client``, which kombu has already set to None:
an ``AttributeError``, which Celery reports as "Unrecoverable error" and which stops the
worker. A coordination worker always holds such messages (``pooled_infer`` waiting for a GPU,
``acks_late``), so every Redis outage or restart took coordination workers down
(``tests/test_faults_redis.py`` found it).

The same happens when a task that was running through the outage finishes after the worker
reconnected: its acknowledgement goes to the old, closed channel, and the worker stops again.

Here a restore that cannot run, and an acknowledgement (or rejection) on a channel whose
connection is gone, are logged and skipped: the messages are still in Redis's unacked index
(where the broker put them when it delivered them), and any worker's periodic sweep restores
them once the visibility timeout has passed (``GPUHEDGE_VISIBILITY_TIMEOUT_S``); every task is
idempotent, so one that finished and runs again is harmless.

**Acknowledgements of coordination tasks ride in the next delivery's round trip.** kombu
acknowledges a message with a round trip of its own (``ZREM`` + ``HDEL`` of the unacked index
and hash) and records the next delivery with another (``ZADD`` + ``HSET``). For the race tasks
(``hedged_infer``, ``race_step``, ``race_submit``, ``race_cancel``: idempotent, and a finished
one only resumes its race when it runs again) the acknowledgement waits, up to
``GPUHEDGE_ACK_LINGER_MS`` (250), to go in the pipeline that records the next delivery; what
no delivery took is sent by a flush on the worker's event loop after that long, and on close.
Celery's own bookkeeping (prefetch, the delivered set) sees the acknowledgement at once. A
worker that dies in between leaves those messages in the unacked index: they are restored
after the visibility timeout, and their tasks resume races that are already running or done.
That needs a race's keys to outlive the visibility timeout: where receipts expire sooner
(``GPUHEDGE_RECEIPT_TTL_S`` below ``GPUHEDGE_VISIBILITY_TIMEOUT_S``) nothing lingers. Other
tasks (pooled GPU jobs, the janitor) are acknowledged at once, as kombu does.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from functools import lru_cache
from time import time
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from ..names import RACE_TASKS
from ..store.connection import primary_changed

log = logging.getLogger(__name__)

TRANSPORT = "gpuhedge_celery.tasks.broker:Transport"
LINGERING_TASKS = RACE_TASKS  # idempotent: a rerun resumes its race


@lru_cache(maxsize=1)
def ack_linger_s() -> float:
    """``GPUHEDGE_ACK_LINGER_MS`` in seconds (read once per process)."""
    from .. import settings

    return settings.current().race.ack_linger_ms / 1000.0


@lru_cache(maxsize=1)
def _receipt_ttl_s() -> float:
    from .. import settings

    return settings.current().receipt_ttl_s


class QoS(kombu_redis.QoS):
    # delivery tag -> message: kombu declares None on the class and sets a dict per instance
    _delivered: dict[Any, Any]  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acks_lock = threading.Lock()  # Celery's pool threads acknowledge
        self._lingering: list[Any] = []  # delivery tags acknowledged, not yet sent to Redis

    def _lingers(self, delivery_tag: Any) -> bool:
        # A task redelivered after the visibility timeout must still find its race's keys
        # (kept for GPUHEDGE_RECEIPT_TTL_S), or it would start the race again: where receipts
        # expire sooner, every acknowledgement goes at once.
        if ack_linger_s() <= 0 or _receipt_ttl_s() < float(self.visibility_timeout):
            return False
        headers = getattr(self._delivered.get(delivery_tag), "headers", None) or {}
        return headers.get("task") in LINGERING_TASKS

    def _take_lingering(self) -> list[Any]:
        with self._acks_lock:
            tags, self._lingering = self._lingering, []
        return tags

    def append(self, message: Any, delivery_tag: Any) -> None:
        """kombu's append (the message recorded as unacked), with the acknowledgements made
        since the last round trip sent in the same pipeline."""
        tags = self._take_lingering()
        delivery = message.delivery_info
        record = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        with self.pipe_or_acquire() as pipe:
            for tag in tags:
                self._remove_from_indices(tag, pipe)
            pipe.zadd(self.unacked_index_key, {delivery_tag: time()})
            pipe.hset(self.unacked_key, delivery_tag, record)
            try:
                pipe.execute()
            except Exception:
                self._keep(tags)  # for the next round trip or flush
                raise
            virtual.QoS.append(self, message, delivery_tag)

    def _keep(self, tags: list[Any]) -> None:
        with self._acks_lock:
            self._lingering[:0] = tags

    def flush_acks(self) -> None:
        """Send the acknowledgements still waiting for a delivery to ride with."""
        if self.channel.connection is None:  # gone: the messages wait for the visibility timeout
            return
        tags = self._take_lingering()
        if not tags:
            return
        try:
            with self.pipe_or_acquire() as pipe:
                for tag in tags:
                    self._remove_from_indices(tag, pipe)
                pipe.execute()
        except Exception as e:
            self._keep(tags)
            log.warning(
                "%d broker acknowledgement(s) not sent yet (%s); sent with the next round trip",
                len(tags),
                e,
            )

    def restore_unacked(self, client: Any = None) -> Any:
        self.flush_acks()  # acknowledged messages are not restored, nor left in the index
        try:
            return super().restore_unacked(client)
        except AttributeError as e:  # the connection is gone (see the module docstring)
            log.warning(
                "broker connection lost with %d unacknowledged message(s): they are "
                "redelivered after the visibility timeout (%s)",
                len(self._delivered),
                e,
            )
            self._delivered.clear()  # kombu asserts an empty state once marked restored
            return None

    def _gone(self, delivery_tag: Any, what: str) -> bool:
        """True (and logged) when this channel's connection is gone: nothing can be sent."""
        if self.channel.connection is not None:
            return False
        log.warning(
            "broker connection lost before a message could be %s: it is redelivered after the "
            "visibility timeout",
            what,
        )
        self._delivered.pop(delivery_tag, None)
        return True

    def ack(self, delivery_tag: Any) -> None:
        if self._gone(delivery_tag, "acknowledged"):
            return
        if not self._lingers(delivery_tag):
            super().ack(delivery_tag)
            return
        with self._acks_lock:
            self._lingering.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # Celery's prefetch sees it at once

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if not self._gone(delivery_tag, "rejected"):
            super().reject(delivery_tag, requeue=requeue)


def _flush_before_close(channel: Any) -> None:
    qos = channel._qos
    if qos is not None and not channel.closed:
        qos.flush_acks()


def _primary_changed_is_lost_connection(read: Callable[[], Any], channel: Any) -> Any:
    """``read()``, a blocking pop; a primary demoted under it (Redis answers the pop with
    UNBLOCKED ... master -> replica) raised as the lost connection it is, so the worker
    reconnects, through the Sentinels, to the new primary instead of stopping as kombu does
    for an error reply."""
    try:
        return read()
    except redis.ResponseError as e:
        if not primary_changed(e):
            raise
        channel.client.connection.disconnect()
        raise redis.ConnectionError(f"the broker's primary changed: {e}") from e


class Channel(kombu_redis.Channel):
    QoS = QoS

    def close(self) -> None:
        _flush_before_close(self)
        super().close()

    def _brpop_read(self, **options: Any) -> Any:
        read = super()._brpop_read
        return _primary_changed_is_lost_connection(lambda: read(**options), self)


class SentinelChannel(kombu_redis.SentinelChannel):
    """The same fixes on kombu's Sentinel channel, which asks the Sentinels for the primary:
    a failover is a lost connection while messages are unacknowledged, like a restart."""

    QoS = QoS

    def close(self) -> None:
        _flush_before_close(self)
        super().close()

    def _brpop_read(self, **options: Any) -> Any:
        read = super()._brpop_read
        return _primary_changed_is_lost_connection(lambda: read(**options), self)


class Transport(kombu_redis.Transport):
    Channel: Any = Channel
    cycle: Any  # kombu's MultiChannelPoller, set up by kombu's Transport

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        old = getattr(self, "_acks_tref", None)
        if old is not None:  # registered again: one flush timer, not one each
            old.cancel()
        self._acks_tref = None
        if ack_linger_s() <= 0:
            return
        # A reconnect builds a new transport: the timer holds this one weakly and stops once it
        # is gone, so old transports neither pile up timers nor stay alive through them.
        ref = weakref.ref(self)

        def flush() -> None:
            transport = ref()
            if transport is None:
                tref.cancel()
                return
            transport._flush_acks()

        tref = loop.call_repeatedly(ack_linger_s(), flush)
        self._acks_tref = tref

    def _flush_acks(self) -> None:
        for channel in list(self.cycle._channels):
            qos = getattr(channel, "_qos", None)
            if qos is not None:
                qos.flush_acks()


class SentinelTransport(Transport):
    """:class:`Transport` for a ``sentinel://`` broker URL."""

    Channel = SentinelChannel
    default_port: Any = kombu_redis.SentinelTransport.default_port
