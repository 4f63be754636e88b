"""The lease listener on a Redis Cluster whose primaries change under it, on private clusters
of real redis-servers: a primary added and given a pool's slot, a primary failed over to its
replica by hand, and a primary killed so that its replica takes over. In each case a deleted
lease key wakes its watcher through events again, without restarting the process. (A demoted
primary still publishes the events of the writes it replicates; the listener does not rely on
that.)"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
import redis

from gpuhedge_celery.store.connection import redis_from_url
from gpuhedge_celery.store.keys import Keys
from gpuhedge_celery.store.listener import TOPOLOGY_EVERY_S, KeyspaceListener
from tests.support.processes import stop_process
from tests.support.redis_cluster import LocalCluster
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(request):
    with LocalCluster(**getattr(request, "param", {})) as found:
        yield found


def listening(cluster: LocalCluster):
    client = redis_from_url(cluster.url, decode_responses=True)
    keys = Keys("topo")
    listener = KeyspaceListener(client, keys).start()
    key = keys.lease("p", "g0")
    return client, listener, key


def woken_by_a_delete(client, listener: KeyspaceListener, key: str) -> bool:
    """Whether deleting ``key`` sets its watcher's event within a second."""
    with listener.watch([key], "p") as watch:
        try:
            client.set(key, "x")
            client.delete(key)
        except redis.RedisError:  # the slot's owner is still changing
            return False
        return watch.event.wait(1.0)


def woken_twice(client, listener: KeyspaceListener, key: str) -> bool:
    """Two deletes in a row each woke the watcher (a reconnect wakes every watcher once)."""
    return woken_by_a_delete(client, listener, key) and woken_by_a_delete(client, listener, key)


def busy(client, stop: threading.Event) -> threading.Thread:
    """Deletes of unrelated keys, about a hundred a second: the listener is never idle."""

    def run() -> None:
        while not stop.is_set():
            with contextlib.suppress(redis.RedisError):
                client.set("busy:x", "1")
                client.delete("busy:x")
            stop.wait(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_pool_moved_to_an_added_primary_still_wakes_its_waiters(cluster):
    client, listener, key = listening(cluster)
    stop = threading.Event()
    busy(client, stop)  # events keep arriving: the topology check must run all the same
    try:
        assert woken_by_a_delete(client, listener, key)
        added = cluster.add_master()
        cluster.move_slot(cluster.key_slot(key), added)
        # within a topology check the listener subscribes on the added primary too
        wait_for(
            lambda: woken_twice(client, listener, key), 4 * TOPOLOGY_EVERY_S + 5,
            "a wake-up from the added primary",
        )  # fmt: skip
        assert f"127.0.0.1:{added.port}" in listener.primaries
    finally:
        stop.set()
        listener.close()


@pytest.mark.parametrize("cluster", [{"replicas": True}], indirect=True)
def test_a_pool_s_primary_failed_over_by_hand_still_wakes_its_waiters(cluster):
    client, listener, key = listening(cluster)
    try:
        old = cluster.owner(cluster.key_slot(key))
        promoted = cluster.failover(old)
        # the demoted primary still relays the events of what it replicates, but the listener
        # subscribes on the promoted one within a topology check all the same
        wait_for(
            lambda: f"127.0.0.1:{promoted.port}" in listener.primaries,
            4 * TOPOLOGY_EVERY_S + 5, "subscribed on the promoted replica",
        )  # fmt: skip
        stop_process(old.process, grace_s=5)  # only the promoted node can tell now
        wait_for(lambda: woken_twice(client, listener, key), 20, "a wake-up from the promoted")
    finally:
        listener.close()


@pytest.mark.parametrize("cluster", [{"replicas": True, "node_timeout_ms": 1000}], indirect=True)
def test_a_pool_s_primary_killed_is_replaced_and_its_waiters_woken_again(cluster):
    client, listener, key = listening(cluster)
    try:
        old = cluster.owner(cluster.key_slot(key))
        promoted = cluster.replica_of(old)
        os.kill(old.process.pid, signal.SIGKILL)
        old.process.wait(10)
        # the replica takes over once the others count its primary as failed (node timeout)
        wait_for(
            lambda: woken_twice(client, listener, key), 30,
            "a wake-up from the replica that took over",
        )  # fmt: skip
        assert f"127.0.0.1:{promoted.port}" in listener.primaries
        assert listener.reconnects >= 1
    finally:
        listener.close()


def test_a_failing_topology_check_is_retried_on_its_timer_not_in_a_storm(cluster, monkeypatch):
    from redis.exceptions import RedisClusterException

    client, listener, key = listening(cluster)
    try:

        def failing(known):
            raise RedisClusterException("All slots are not covered after query all startup_nodes")

        monkeypatch.setattr(listener.client, "primaries_not_in", failing)
        before = listener.reconnects
        time.sleep(2 * TOPOLOGY_EVERY_S + 0.5)
        assert listener.reconnects == before  # nothing dropped, nobody woken for it
        assert woken_twice(client, listener, key)  # and the events still flow
    finally:
        listener.close()
