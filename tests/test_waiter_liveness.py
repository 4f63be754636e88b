"""A waiter that cannot take a free GPU (killed, paused, stuck) does not keep it idle.

Real processes on a real redis-server: a "victim" process queues first and is killed with
SIGKILL or paused with SIGSTOP; live waiters in another process queue behind it. Every handoff
to a live waiter is timed from just before the GPU's release (time.monotonic, comparable across
processes) and must take at most HANDOFF_BOUND_S; live waiters are served in arrival order.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from gpuhedge_celery.store.liveness import PROCESS_TTL_MS
from gpuhedge_celery.store.waiter import PASS_OVER_S, LeaseWaiter
from tests.support.fixtures_leases import SPAWN, add_pool, wait_until, waiting_threads

pytestmark = [
    pytest.mark.usefixtures("listeners_closed"),
    pytest.mark.timeout(90),
    pytest.mark.cluster,
]

HANDOFF_BOUND_S = 0.150
POOL = "default"


def start_waiters(redis_url: str, prefix: str, groups: list[tuple[list[str], float]]):
    """One process per (holders, hold_s) group, started together; returns (proc, out, go)s."""
    started = []
    for holders, hold_s in groups:
        out, go = SPAWN.Queue(), SPAWN.Event()
        proc = SPAWN.Process(
            target=waiting_threads,
            args=(redis_url, prefix, POOL, holders, hold_s, out, go),
            daemon=True,
        )
        proc.start()
        started.append((proc, out, go))
    for _, out, _ in started:
        assert out.get(timeout=60)[0] == "ready"
    return started


def queue_up(store, group, expected: list[str]) -> None:
    """Let ``group``'s threads queue, and wait until the pool's queue is exactly ``expected``."""
    group[2].set()
    assert wait_until(lambda: store.queue(POOL) == expected, 20), store.queue(POOL)


def collect(out, holders: list[str], timeout_s: float = 30) -> dict[str, dict]:
    """Every holder's acquire and release reports: {holder: {"gpu", "token", "got", "freed"}}."""
    found: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while not all("freed" in found.get(h, {}) for h in holders):
        kind, holder, gpu, token, at = out.get(timeout=max(0.1, deadline - time.monotonic()))
        row = found.setdefault(holder, {"gpu": gpu, "token": token})
        row["got" if kind == "acquired" else "freed"] = at
    return found


def handoff_gaps(rows: dict[str, dict], released: dict[str, float]) -> dict[str, float]:
    """Per holder: from the release of the GPU it got (the parent's, or the previous holder's)
    to holding it."""
    gaps = {}
    for holder, row in rows.items():
        before = [r for r in rows.values() if r["gpu"] == row["gpu"] and r["token"] < row["token"]]
        freed = max(before, key=lambda r: r["token"])["freed"] if before else released[row["gpu"]]
        gaps[holder] = row["got"] - freed
    return gaps


def by_token(rows: dict[str, dict]) -> list[str]:
    return [h for h, _ in sorted(rows.items(), key=lambda kv: (kv[1]["got"], kv[1]["token"]))]


def assert_fast(gaps: dict[str, float]) -> None:
    slow = {h: round(g, 4) for h, g in gaps.items() if not 0 <= g <= HANDOFF_BOUND_S}
    assert not slow, f"handoffs over {HANDOFF_BOUND_S} s: {slow} (all: {gaps})"


def test_killed_head_waiter_does_not_hold_a_free_gpu(lease_store, redis_url, prefix):
    (gpu,) = add_pool(lease_store)
    held = lease_store.try_claim(gpu, "holder")
    live = ["l0", "l1", "l2"]
    victim, waiters = start_waiters(redis_url, prefix, [(["dead"], 0.0), (live, 0.05)])
    queue_up(lease_store, victim, ["dead"])
    queue_up(lease_store, waiters, ["dead", *live])
    os.kill(victim[0].pid, signal.SIGKILL)
    victim[0].join(10)
    released = time.monotonic()
    lease_store.release(held)
    rows = collect(waiters[1], live)
    assert by_token(rows) == live  # FIFO among the live waiters
    assert_fast(handoff_gaps(rows, {gpu: released}))
    assert lease_store.queue(POOL) == []  # the dead waiter's entry went with it
    waiters[0].join(10)


@pytest.mark.parametrize("n_gpus", [1, 4])
def test_killed_process_with_many_waiting_threads(lease_store, redis_url, prefix, n_gpus):
    """A coordination process with six waiting threads at the head of the queue dies at once.
    The first wave of live waiters gets the GPUs freed together; it frees them 50 ms apart, so
    the two waiters left get them one at a time, in arrival order."""
    gpus = add_pool(lease_store, n=n_gpus)
    held = [lease_store.try_claim(g, "holder") for g in gpus]
    dead = [f"d{i}" for i in range(6)]
    live = [f"l{i}" for i in range(n_gpus + 2)]
    hold_s = {holder: 0.3 + 0.05 * i for i, holder in enumerate(live)}
    victim, waiters = start_waiters(redis_url, prefix, [(dead, 0.0), (live, hold_s)])
    queue_up(lease_store, victim, dead)
    queue_up(lease_store, waiters, dead + live)
    os.kill(victim[0].pid, signal.SIGKILL)
    victim[0].join(10)
    released = {}
    for lease in held:
        released[lease.gpu_id] = time.monotonic()
        lease_store.release(lease)
    rows = collect(waiters[1], live)
    assert_fast(handoff_gaps(rows, released))
    served = by_token(rows)
    # FIFO: the GPUs freed together go to the longest live waiters (in any order among them),
    # then the second wave is served after them, in arrival order.
    assert set(served[:n_gpus]) == set(live[:n_gpus])
    assert served[n_gpus:] == live[n_gpus:], served
    assert lease_store.queue(POOL) == []
    waiters[0].join(10)


def test_paused_head_waiter_is_passed_over_and_dropped_after_its_heartbeat_lapses(
    lease_store, redis_url, prefix
):
    """SIGSTOP the head waiter's process and free the GPU at once: the next live waiter takes
    it after the pass-over window while the paused one keeps its place; once its heartbeat is
    PROCESS_TTL_MS old it is dropped; resumed, it queues again at the back and is served."""
    (gpu,) = add_pool(lease_store)
    held = lease_store.try_claim(gpu, "holder")
    live = ["l0", "l1"]
    hold_s = PROCESS_TTL_MS / 1000 + 0.3  # l0 releases after the paused heartbeat lapsed
    victim, waiters = start_waiters(redis_url, prefix, [(["paused"], 0.0), (live, hold_s)])
    queue_up(lease_store, victim, ["paused"])
    queue_up(lease_store, waiters, ["paused", *live])
    os.kill(victim[0].pid, signal.SIGSTOP)
    try:
        released = time.monotonic()
        lease_store.release(held)
        kind, holder, _gpu, l0_token, got = waiters[1].get(timeout=10)
        assert (kind, holder) == ("acquired", "l0")
        assert PASS_OVER_S - 0.005 <= got - released <= HANDOFF_BOUND_S  # passed over
        assert lease_store.queue(POOL) == ["paused", "l1"]  # it kept its place meanwhile
        kind, holder, *_, freed = waiters[1].get(timeout=10)
        assert (kind, holder) == ("released", "l0")
        kind, holder, _gpu, l1_token, got = waiters[1].get(timeout=10)
        assert (kind, holder) == ("acquired", "l1")
        assert 0 <= got - freed <= HANDOFF_BOUND_S, got - freed  # no pass-over wait
        assert lease_store.queue(POOL) == []  # silent for longer than PROCESS_TTL_MS: dropped
    finally:
        os.kill(victim[0].pid, signal.SIGCONT)
    # Resumed, it re-joins at the back and still gets the GPU after l1.
    assert wait_until(lambda: lease_store.queue(POOL) == ["paused"], 5), lease_store.queue(POOL)
    rows = collect(victim[1], ["paused"])
    assert held.token < l0_token < l1_token < rows["paused"]["token"] == lease_store.last_token(gpu)
    for proc, _, _ in (victim, waiters):
        proc.join(10)


def test_stuck_waiting_thread_is_passed_over_but_keeps_its_place(lease_store):
    """Only the head's thread is stuck (its process heartbeats on): the waiter behind it takes
    the free GPU after the pass-over window, and the head is served next, ahead of later ones."""
    (gpu,) = add_pool(lease_store)
    held = lease_store.try_claim(gpu, "holder")
    gate = threading.Event()
    stuck = LeaseWaiter(lease_store)
    stuck.after_check = lambda: gate.wait(10)  # blocks after its first check
    got = {}

    def acquire(waiter, holder, hold_s):
        lease = waiter.acquire(POOL, holder, timeout_s=30)
        got[holder] = (time.monotonic(), lease.token)
        time.sleep(hold_s)
        lease_store.release(lease)

    threads = [threading.Thread(target=acquire, args=(stuck, "stuck", 0), daemon=True)]
    threads[0].start()
    assert wait_until(lambda: lease_store.queue(POOL) == ["stuck"], 5)
    for name in ("next", "later"):
        threads.append(threading.Thread(target=acquire, args=(LeaseWaiter(lease_store), name, 0.3)))
        threads[-1].start()
        assert wait_until(lambda n=name: lease_store.queue(POOL)[-1:] == [n], 5)
    released = time.monotonic()
    lease_store.release(held)
    assert wait_until(lambda: "next" in got, 5)
    assert got["next"][0] - released <= HANDOFF_BOUND_S
    assert lease_store.queue(POOL) == ["stuck", "later"]
    gate.set()
    for thread in threads:
        thread.join(20)
    assert sorted(got, key=lambda h: got[h][1]) == ["next", "stuck", "later"]
