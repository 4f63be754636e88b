"""Fixtures and subprocess bodies for the lease-store, waiter and listener tests.

Functions run in child processes live here (not in test modules) so the ``spawn`` start method
can import them; spawn rather than fork because the test process runs listener threads.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time

import pytest

from gpuhedge_celery.errors import LeaseLost, StaleToken
from gpuhedge_celery.store.connection import redis_from_url
from gpuhedge_celery.store.keeper import LeaseKeeper
from gpuhedge_celery.store.leases import GpuInfo, LeaseStore
from gpuhedge_celery.store.listener import close_listeners
from gpuhedge_celery.store.waiter import LeaseWaiter

SPAWN = multiprocessing.get_context("spawn")


def make_store(url: str, prefix: str) -> LeaseStore:
    return LeaseStore(redis_from_url(url, decode_responses=True), prefix=prefix)


def add_pool(
    store: LeaseStore,
    pool: str = "default",
    n: int = 1,
    *,
    host: str = "h1",
    ttl_ms: int | None = None,
    heartbeat_ms: int = 120_000,
    labels: list[dict[str, str]] | None = None,
) -> list[str]:
    """Register ``n`` GPUs ``host:i`` in ``pool`` on a heartbeating host; returns their ids."""
    ids = []
    for i in range(n):
        gpu_id = f"{host}:{i}"
        store.register_gpu(GpuInfo(gpu_id, pool, host, (labels or [{}] * n)[i]))
        ids.append(gpu_id)
    store.host_heartbeat(host, heartbeat_ms)
    if ttl_ms is not None:
        store.set_pool_ttl(pool, ttl_ms)
    return ids


@pytest.fixture
def lease_store(redis_client, prefix):
    """A LeaseStore on the shared real redis-server under this test's own prefix."""
    yield LeaseStore(redis_client, prefix=prefix)
    close_listeners()


@pytest.fixture
def silent_redis():
    """A private redis-server where CONFIG is forbidden (as on managed Redis): no events."""
    from tests.support.redis_server import start_redis_server

    try:
        server = start_redis_server("--rename-command", "CONFIG", "")
    except RuntimeError as e:
        pytest.fail(str(e))
    yield server
    close_listeners()
    server.stop()


@pytest.fixture
def listeners_closed():
    """Stop this process's lease listeners after the test (their servers may be gone)."""
    yield
    close_listeners()


def wait_until(predicate, timeout_s: float = 10.0, every_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return bool(predicate())


# -- bodies of child processes ---------------------------------------------------------------
def contention_worker(url: str, prefix: str, gpus: list[str], claims: int, seed: int, out) -> None:
    """Claim GPUs until ``claims`` claims succeeded; report every held interval."""
    store = make_store(url, prefix)
    rng = random.Random(seed)
    holder = f"w{seed}"
    intervals = []
    attempts = 0
    while len(intervals) < claims:
        gpu = rng.choice(gpus)
        attempts += 1
        lease = store.try_claim(gpu, holder, ttl_ms=30_000)
        if lease is None:
            continue
        start = time.monotonic()
        end = time.monotonic()
        intervals.append((gpu, lease.token, start, end))
        store.release(lease)
    out.put((seed, attempts, intervals))


def paused_holder(url: str, prefix: str, gpu: str, ttl_ms: int, out, go) -> None:
    """Claim with a keeper running, get paused by the parent, then report how the store answers."""
    store = make_store(url, prefix)
    lease = store.try_claim(gpu, "paused-holder", ttl_ms=ttl_ms)
    lost_calls = []
    keeper = LeaseKeeper(
        store, lease, on_lost=lambda ls, e: lost_calls.append(type(e).__name__), interval_s=0.1
    ).start()
    out.put(("claimed", lease.token, os.getpid()))
    go.wait(30)
    report = {"keeper_lost": keeper.lost.wait(5)}
    for name, call in (
        ("release", lambda: store.release(lease)),
        ("renew", lambda: store.renew(lease)),
        ("check_fence", lambda: store.check_fence(gpu, lease.token)),
    ):
        try:
            call()
            report[name] = "accepted"
        except (LeaseLost, StaleToken) as e:
            report[name] = type(e).__name__
    time.sleep(0.3)
    report["on_lost_after"] = list(lost_calls)
    keeper.stop()
    out.put(("report", report))


def queued_waiter(
    url: str, prefix: str, pool: str, holder: str, recheck_s: float, hold_s: float, out, go
) -> None:
    """Wait for ``go``, then acquire a GPU of ``pool``, hold it ``hold_s`` and release it."""
    store = make_store(url, prefix)
    waiter = LeaseWaiter(store, recheck_s=recheck_s)
    assert waiter.listener.alive  # subscribed before the parent counts us as queued
    out.put(("ready", holder, None, None))
    go.wait(60)
    lease = waiter.acquire(pool, holder, timeout_s=60)
    got = time.monotonic()
    out.put(("acquired", holder, lease.token, got))
    time.sleep(hold_s)
    store.release(lease)


def waiting_threads(
    url: str, prefix: str, pool: str, holders: list[str], hold_s: float | dict[str, float], out, go
) -> None:
    """Once ``go`` is set, start one waiting thread per holder, in list order (each joins the
    queue after the one before it). Each reports ``("acquired", holder, gpu, token, t)`` when it
    holds a GPU and ``("released", holder, gpu, token, t)`` just before releasing it ``hold_s``
    (or ``hold_s[holder]``) later (t: time.monotonic, comparable across processes on one
    machine)."""
    store = make_store(url, prefix)
    waiter = LeaseWaiter(store, recheck_s=1.0)
    assert waiter.listener.alive  # subscribed and heartbeating before the parent counts us
    out.put(("ready", os.getpid()))
    go.wait(60)

    def run(holder: str, done: threading.Event) -> None:
        lease = waiter.acquire(pool, holder, timeout_s=60)
        done.set()
        out.put(("acquired", holder, lease.gpu_id, lease.token, time.monotonic()))
        time.sleep(hold_s[holder] if isinstance(hold_s, dict) else hold_s)
        out.put(("released", holder, lease.gpu_id, lease.token, time.monotonic()))
        store.release(lease)

    threads = []
    for holder in holders:
        done = threading.Event()
        thread = threading.Thread(target=run, args=(holder, done), daemon=True)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 20
        while not done.is_set() and holder not in store.queue(pool):
            assert time.monotonic() < deadline, f"{holder} never queued"
            time.sleep(0.002)
    for thread in threads:
        thread.join(90)
