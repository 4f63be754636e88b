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
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

TRANSPORT = "gpuhedge_celery.tasks.broker:Transport"


class QoS(kombu_redis.QoS):
    def restore_unacked(self, client: Any = None) -> Any:
        try:
            return super().restore_unacked(client)
        except AttributeError as e:  # the connection is gone (see the module docstring)
            log.warning(
                "broker connection lost with %d unacknowledged message(s): they are "
                "redelivered after the visibility timeout (%s)", len(self._delivered), e,
            )  # fmt: skip
            self._delivered.clear()  # kombu asserts an empty state once marked restored
            return None

    def _gone(self, delivery_tag: Any, what: str) -> bool:
        """True (and logged) when this channel's connection is gone: nothing can be sent."""
        if self.channel.connection is not None:
            return False
        log.warning(
            "broker connection lost before a message could be %s: it is redelivered after the "
            "visibility timeout", what,
        )  # fmt: skip
        self._delivered.pop(delivery_tag, None)
        return True

    def ack(self, delivery_tag: Any) -> None:
        if not self._gone(delivery_tag, "acknowledged"):
            super().ack(delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if not self._gone(delivery_tag, "rejected"):
            super().reject(delivery_tag, requeue=requeue)


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel
