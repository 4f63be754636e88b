"""Waiting for a GPU: FIFO order, the check/wait race window, due-lease probes, bad input."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from gpuhedge_celery.errors import AcquireTimeout, ConfigError, EmptyPool, UnknownPool
from gpuhedge_celery.store.keeper import LeaseKeeper
from gpuhedge_celery.store.waiter import LeaseWaiter, waiter_for
from tests.support.fixtures_leases import SPAWN, add_pool, make_store, queued_waiter, wait_until

pytestmark = [pytest.mark.usefixtures("listeners_closed"), pytest.mark.cluster]


def acquire_in_thread(waiter, *args, **kwargs):
    box = {}

    def run():
        try:
            box["lease"] = waiter.acquire(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
        box["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_free_gpu_is_claimed_at_once(lease_store):
    add_pool(lease_store, n=2, ttl_ms=7_000)
    waiter = LeaseWaiter(lease_store)
    a = waiter.acquire("default", "a")
    b = waiter.acquire("default", "b")
    assert {a.gpu_id, b.gpu_id} == {"h1:0", "h1:1"} and a.ttl_ms == 7_000
    assert lease_store.queue("default") == []


def test_fifo_order_under_sustained_contention(lease_store, redis_url, prefix):
    """Waiters in separate processes are served strictly in arrival order, late arrivals too."""
    (gpu,) = add_pool(lease_store)
    first = lease_store.try_claim(gpu, "holder")
    names = [f"w{i}" for i in range(8)]
    out = SPAWN.Queue()
    gos = {n: SPAWN.Event() for n in names}
    procs = [
        SPAWN.Process(
            target=queued_waiter,
            args=(redis_url, prefix, "default", n, 0.5, 0.15, out, gos[n]),
        )
        for n in names
    ]
    for p in procs:
        p.start()
    ready = {out.get(timeout=60)[1] for _ in procs}
    assert ready == set(names)
    acquired = []

    def drain():
        while not out.empty():
            acquired.append(out.get())

    # Five queue up before the GPU frees; three more arrive while it is being handed along.
    for i, name in enumerate(names):
        gos[name].set()
        assert wait_until(
            lambda n=name: (
                (drain() or True)
                and (n in lease_store.queue("default") or any(a[1] == n for a in acquired))
            ),
            20,
        ), f"{name} never queued"
        if i == 4:
            lease_store.release(first)
    while len(acquired) < len(names):
        acquired.append(out.get(timeout=60))
    for p in procs:
        p.join(30)
    served = [holder for _, holder, _token, _at in sorted(acquired, key=lambda a: a[2])]
    assert served == names


def test_a_process_with_sockets_numbered_past_1024_still_hears_its_gpu_freed(lease_store):
    """A long-lived worker holds many descriptors: the listener's sockets (one per primary of a
    cluster) are then numbered past what select() takes, and its wake-ups must still come."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 2048), hard), hard))
    filler = []
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as e:
        pytest.fail(f"cannot open descriptors past 1024 here ({e}); raise `ulimit -n`")
    try:
        (gpu,) = add_pool(lease_store)
        held = lease_store.try_claim(gpu, "holder")
        waiter = LeaseWaiter(lease_store, recheck_s=30)  # only an event can wake it in time
        thread, box = acquire_in_thread(waiter, "default", "w", timeout_s=20)
        assert wait_until(lambda: lease_store.queue("default") == ["w"], 5)
        started = time.monotonic()
        lease_store.release(held)
        thread.join(10)
        assert box.get("lease") is not None and time.monotonic() - started < 5, box
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_race_window_gpu_freed_between_check_and_wait(lease_store):
    """The GPU frees right after the waiter's check saw it held: the event still wakes it."""
    (gpu,) = add_pool(lease_store)
    held = lease_store.try_claim(gpu, "holder")
    waiter = LeaseWaiter(lease_store, recheck_s=30)  # only an event can wake it in time
    checks = []

    def release_in_the_window():
        checks.append(time.monotonic())
        if len(checks) == 1:
            lease_store.release(held)

    waiter.after_check = release_in_the_window
    started = time.monotonic()
    lease = waiter.acquire("default", "waiter", timeout_s=20)
    assert lease.gpu_id == gpu and lease.token > held.token
    assert time.monotonic() - started < 3
    assert len(checks) == 1  # woken straight out of the first wait


def test_due_lease_is_probed_without_events(silent_redis):
    """A holder dies: with no keyspace events at all, the waiter probes the lease when due."""
    store = make_store(silent_redis.url, "p")
    (gpu,) = add_pool(store)
    dead = store.try_claim(gpu, "dead-holder", ttl_ms=400)
    waiter = LeaseWaiter(store, recheck_s=10)
    started = time.monotonic()
    lease = waiter.acquire("default", "next", timeout_s=20)
    waited = time.monotonic() - started
    assert lease.token > dead.token
    assert 0.3 <= waited < 2.0  # at its deadline, not at the 10 s re-check


def test_timeout_leaves_the_queue(lease_store):
    (gpu,) = add_pool(lease_store)
    lease_store.try_claim(gpu, "holder")
    waiter = LeaseWaiter(lease_store)
    started = time.monotonic()
    with pytest.raises(AcquireTimeout, match="within 0.3 s"):
        waiter.acquire("default", "impatient", timeout_s=0.3)
    assert 0.25 <= time.monotonic() - started < 2
    assert lease_store.queue("default") == []


def test_leave_cancels_a_queued_wait_from_elsewhere(lease_store):
    (gpu,) = add_pool(lease_store)
    lease_store.try_claim(gpu, "holder")
    thread, box = acquire_in_thread(LeaseWaiter(lease_store), "default", "victim", timeout_s=20)
    assert wait_until(lambda: lease_store.queue("default") == ["victim"], 5)
    other = LeaseWaiter(lease_store)
    assert other.leave("default", "victim") is True
    cancelled = time.monotonic()
    thread.join(10)
    assert box["at"] - cancelled < 0.8  # told at once, not at its 1 s re-check
    assert isinstance(box.get("error"), AcquireTimeout) and "cancelled" in str(box["error"])
    assert lease_store.queue("default") == []
    assert other.leave("default", "victim") is False


def test_dead_waiter_is_aged_out(lease_store, redis_url, prefix):
    """A queued waiter whose process was killed does not block the waiters behind it."""
    (gpu,) = add_pool(lease_store)
    held = lease_store.try_claim(gpu, "holder")
    out, go = SPAWN.Queue(), SPAWN.Event()
    doomed = SPAWN.Process(
        target=queued_waiter, args=(redis_url, prefix, "default", "doomed", 0.2, 0, out, go)
    )
    doomed.start()
    out.get(timeout=60)
    go.set()
    assert wait_until(lambda: lease_store.queue("default") == ["doomed"], 20)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(10)
    thread, box = acquire_in_thread(LeaseWaiter(lease_store, recheck_s=0.2), "default", "alive")
    assert wait_until(lambda: lease_store.queue("default") == ["doomed", "alive"], 5)
    lease_store.release(held)
    released = time.monotonic()
    thread.join(15)
    assert box["lease"].holder == "alive"
    # doomed's liveness: 3 re-checks (0.6 s) + 2 s grace after its last check.
    assert box["at"] - released < 5
    assert lease_store.queue("default") == []


def test_labels_pick_matching_gpu_and_do_not_block_others(lease_store):
    add_pool(lease_store, n=2, labels=[{"model": "small"}, {"model": "big"}])
    big = lease_store.try_claim("h1:1", "holder")
    waiter = LeaseWaiter(lease_store)
    t_big, box_big = acquire_in_thread(waiter, "default", "wants-big", labels={"model": "big"})
    assert wait_until(lambda: lease_store.queue("default") == ["wants-big"], 5)
    any_gpu = waiter.acquire("default", "anyone", timeout_s=5)  # behind it, but small is free
    assert any_gpu.gpu_id == "h1:0"
    lease_store.release(big)
    t_big.join(10)
    assert box_big["lease"].gpu_id == "h1:1"
    with pytest.raises(EmptyPool):
        waiter.acquire("default", "x", labels={"model": "huge"}, timeout_s=1)


def test_two_gpus_free_serve_two_waiters(lease_store):
    add_pool(lease_store, n=2)
    a = lease_store.try_claim("h1:0", "a")
    b = lease_store.try_claim("h1:1", "b")
    waiter = LeaseWaiter(lease_store)
    threads = [acquire_in_thread(waiter, "default", f"w{i}", timeout_s=10) for i in range(2)]
    assert wait_until(lambda: len(lease_store.queue("default")) == 2, 5)
    lease_store.release(a)
    lease_store.release(b)
    for thread, _ in threads:
        thread.join(10)
    assert sorted(box["lease"].gpu_id for _, box in threads) == ["h1:0", "h1:1"]


def test_bad_input_is_typed(lease_store):
    add_pool(lease_store, "dead", host="gone", heartbeat_ms=100)
    add_pool(lease_store, "live", host="here")
    waiter = waiter_for(lease_store)
    assert waiter_for(lease_store) is waiter
    with pytest.raises(UnknownPool, match="nope"):
        waiter.acquire("nope", "a", timeout_s=1)
    assert wait_until(lambda: not lease_store.host_live("gone"), 3)
    with pytest.raises(EmptyPool, match="dead"):
        waiter.acquire("dead", "a", timeout_s=1)
    with pytest.raises(ConfigError, match="ttl_ms"):
        waiter.acquire("live", "a", ttl_ms=0)
    with pytest.raises(ConfigError, match="timeout"):
        waiter.acquire("live", "a", timeout_s=-1)
    with pytest.raises(ConfigError, match="recheck"):
        LeaseWaiter(lease_store, recheck_s=0)
    assert lease_store.queue("dead") == [] and lease_store.queue("nope") == []


def test_gpu_added_while_waiting_is_picked_up(lease_store):
    """A GPU registered mid-wait is seen within a re-check, even while the held lease is kept
    short-lived by renewals (so the waiter's sleeps are cut to its PTTL, never a full period)."""
    (gpu,) = add_pool(lease_store)
    held = lease_store.try_claim(gpu, "holder", ttl_ms=300)
    with LeaseKeeper(lease_store, held, interval_s=0.05):
        thread, box = acquire_in_thread(
            LeaseWaiter(lease_store, recheck_s=0.3), "default", "w", timeout_s=10
        )
        assert wait_until(lambda: lease_store.queue("default") == ["w"], 5)
        add_pool(lease_store, n=1, host="h2")
        added = time.monotonic()
        thread.join(10)
    assert box["lease"].gpu_id == "h2:0"
    assert box["at"] - added < 0.3 + 0.7
