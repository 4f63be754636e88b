"""Polling with a deadline, for tests that wait on other processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.02) -> T:
    """Return the first truthy value of ``predicate()``; AssertionError naming ``what`` at the
    deadline (so a hung condition fails with a readable message, never hangs the suite)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def wait_until_subscribed(app, events: list[dict], timeout_s: float = 10.0) -> None:
    """Send probe task events on ``app``'s broker until the receiver collecting into ``events``
    sees one: events sent before a receiver subscribes are lost (pub/sub)."""
    import uuid

    probe = f"subscription-probe-{uuid.uuid4().hex}"

    def seen() -> bool:  # a probe a round: any of them seen is the subscription in place
        with app.events.default_dispatcher() as dispatcher:
            dispatcher.send("task-test-probe", uuid=probe)
        return any(e.get("uuid") == probe for e in list(events))

    wait_for(seen, timeout_s, "the event receiver to subscribe", every_s=0.1)


def subscribers(client, *channels: str) -> list[tuple[str, int]]:
    """``PUBSUB NUMSUB`` of ``channels``; on a Redis Cluster summed over every primary, since
    a subscriber counts only on the node it subscribed on."""
    from redis.cluster import RedisCluster

    from gpuhedge_celery.store.cluster import ClusterClient

    if isinstance(client, ClusterClient):
        return client.pubsub_numsub(*channels, target_nodes=RedisCluster.PRIMARIES)
    return client.pubsub_numsub(*channels)
