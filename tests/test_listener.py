"""The keyspace listener: enabling events, and waiters that still get GPUs when events are lost."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from gpuhedge_celery.errors import NotificationsUnavailable
from gpuhedge_celery.store.listener import (
    KeyspaceListener,
    enable_notifications,
    listener_for,
    require_notifications,
)
from gpuhedge_celery.store.waiter import LeaseWaiter
from tests.support.fixtures_leases import add_pool, make_store, wait_until

pytestmark = [pytest.mark.usefixtures("listeners_closed"), pytest.mark.cluster]

MARGIN_S = 0.7  # the machine is shared and loaded


def relay(store, waiters, holder_lease, *, release):
    """Queue ``waiters`` (holder, LeaseWaiter) in order, then ``release()``; each waiter that gets
    the GPU holds it 50 ms and releases. Returns [(holder, freed_at, got_at)] in service order."""
    log = []
    lock = threading.Lock()
    freed = {"at": None}

    def run(name, waiter):
        lease = waiter.acquire("default", name, timeout_s=30)
        got = time.monotonic()
        with lock:
            log.append((name, freed["at"], got))
        time.sleep(0.05)
        with lock:
            freed["at"] = time.monotonic()
            store.release(lease)

    threads = []
    for i, (name, waiter) in enumerate(waiters):
        t = threading.Thread(target=run, args=(name, waiter), daemon=True)
        t.start()
        threads.append(t)
        assert wait_until(lambda i=i: len(store.queue("default")) == i + 1, 10)
    freed["at"] = time.monotonic()
    release()
    for t in threads:
        t.join(40)
    return log


def test_enable_notifications_keeps_existing_flags(private_redis):
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    client.config_set("notify-keyspace-events", "Kl")
    assert enable_notifications(client) is True
    flags = client.config_get("notify-keyspace-events")["notify-keyspace-events"]
    assert set(flags) >= set("KlEgx")
    assert enable_notifications(client) is True  # idempotent
    assert client.config_get("notify-keyspace-events")["notify-keyspace-events"] == flags


def test_config_forbidden_logs_one_line_and_waiters_still_get_gpus(silent_redis, caplog):
    """No events at all (CONFIG refused, so they cannot be enabled): the re-check hands over."""
    store = make_store(silent_redis.url, "p")
    (gpu,) = add_pool(store)
    with caplog.at_level(logging.WARNING, logger="gpuhedge_celery.store.listener"):
        assert enable_notifications(store.client) is False
        assert enable_notifications(store.client) is False
        recheck = 0.3
        waiters = [(f"w{i}", LeaseWaiter(store, recheck_s=recheck)) for i in range(4)]
        held = store.try_claim(gpu, "holder")
        log = relay(store, waiters, held, release=lambda: store.release(held))
    lines = [r for r in caplog.records if "notify-keyspace-events" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0].getMessage()
    assert "parameter group" in lines[0].getMessage()
    assert [name for name, _, _ in log] == ["w0", "w1", "w2", "w3"]
    for name, freed, got in log:
        assert got - freed <= recheck + MARGIN_S, f"{name} waited {got - freed:.3f} s"
    listener = listener_for(store.client, store.keys)
    assert listener.notifications is False
    with pytest.raises(NotificationsUnavailable, match="parameter group"):
        require_notifications(store.client)


def test_pubsub_killed_during_release(private_redis):
    """The listener's connection dies as the GPU frees: waiters still get it within the bound,
    and once reconnected the listener delivers events again."""
    store = make_store(private_redis.url, "p")
    (gpu,) = add_pool(store)
    admin = redis.Redis.from_url(private_redis.url, decode_responses=True)
    recheck = 1.0
    waiters = [(f"w{i}", LeaseWaiter(store, recheck_s=recheck)) for i in range(3)]
    listener = listener_for(store.client, store.keys)
    assert listener.notifications is True
    held = store.try_claim(gpu, "holder")

    def kill_and_release():
        assert admin.client_kill_filter(_type="pubsub") >= 1
        store.release(held)

    log = relay(store, waiters, held, release=kill_and_release)
    assert sorted(name for name, _, _ in log) == ["w0", "w1", "w2"]
    for name, freed, got in log:
        assert got - freed <= recheck + MARGIN_S, f"{name} waited {got - freed:.3f} s"
    assert wait_until(lambda: listener.reconnects >= 1, 5)
    # Events flow again: with a 20 s re-check, only an event can hand over this fast.
    assert len(admin.pubsub_channels()) >= 1
    held = store.try_claim(gpu, "holder-2")
    slow = [("after", LeaseWaiter(store, recheck_s=20))]
    log = relay(store, slow, held, release=lambda: store.release(held))
    assert log[0][2] - log[0][1] < 1.0


def test_one_pubsub_connection_per_process(private_redis):
    store = make_store(private_redis.url, "p")
    (gpu,) = add_pool(store)
    held = store.try_claim(gpu, "holder")
    waiters = [LeaseWaiter(store) for _ in range(4)]
    threads = []
    for i, w in enumerate(waiters):
        t = threading.Thread(target=w.acquire, args=("default", f"w{i}"), daemon=True)
        t.start()
        threads.append(t)
    assert wait_until(lambda: len(store.queue("default")) == 4, 10)
    admin = redis.Redis.from_url(private_redis.url, decode_responses=True)
    pubsub_clients = [c for c in admin.client_list() if int(c.get("sub", 0)) > 0]
    assert len(pubsub_clients) == 1
    for i in range(4):
        store.release(held)
        assert wait_until(lambda i=i: store.current(gpu) is not None, 5)
        held = store.current(gpu)
    store.release(held)
    for t in threads:
        t.join(10)


def test_a_listener_that_fails_to_subscribe_says_why_at_once(private_redis, monkeypatch):
    """Not only a lost connection: any failure while subscribing is reported by start(), not
    left to its timeout with the reason lost in a dead thread."""
    from gpuhedge_celery.errors import StoreUnavailable
    from gpuhedge_celery.store import listener as listener_module

    def broken(client, channels):
        raise ValueError("filedescriptor out of range in select()")

    monkeypatch.setattr(listener_module.Subscriptions, "of", broken)
    store = make_store(private_redis.url, "says-why")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="filedescriptor out of range"):
        KeyspaceListener(store.client, store.keys).start(timeout_s=5)
    assert time.monotonic() - started < 2
