"""The timer service with real processes on a real redis-server: once each, on time, crash-safe.

Timing bounds are generous (other test runs share this 2-core machine); each one is still far
below what the behaviour under test would cost without the mechanism (a poll interval, a lease).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import redis

from gpuhedge_celery.store.connection import redis_from_url
from gpuhedge_celery.store.timer_service import TimerService
from gpuhedge_celery.store.timers import Timer, TimerStore
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(90), pytest.mark.cluster]

# spawn, not fork: earlier tests leave listener threads whose held locks a fork would copy
ctx = multiprocessing.get_context("spawn")


def now_ms() -> int:
    return int(time.time() * 1000)


class Recorder:
    """A handler that records (timer, fired-at ms) in this process."""

    def __init__(self):
        self.fired: list[tuple[Timer, int]] = []
        self.lock = threading.Lock()

    def __call__(self, timer: Timer) -> None:
        with self.lock:
            self.fired.append((timer, now_ms()))


def _serve_into_file(url: str, prefix: str, path: str, lease_ms: int) -> None:
    """Child process: fire timers, appending ``id deliveries`` lines to ``path`` (unbuffered)."""
    client = redis_from_url(url, decode_responses=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def handler(timer: Timer) -> None:
        os.write(fd, f"{timer.id} {timer.deliveries}\n".encode())

    TimerService(TimerStore(client, prefix), handler, batch=10, lease_ms=lease_ms).start()
    time.sleep(120)  # killed by the test long before


def _claim_then_hang(url: str, prefix: str, lease_ms: int, claimed) -> None:
    """Child process: a service whose handler hangs, so its claimed timers stay in flight."""
    client = redis_from_url(url, decode_responses=True)

    def handler(timer: Timer) -> None:
        claimed.set()
        time.sleep(120)

    TimerService(TimerStore(client, prefix), handler, batch=100, lease_ms=lease_ms).start()
    time.sleep(120)


def _arm_and_die(url: str, prefix: str, due_ms: int) -> None:
    client = redis_from_url(url, decode_responses=True)
    TimerStore(client, prefix).arm("orphan|safety", due_ms, {"from": "dead armer"})
    os._exit(0)


def _read_lines(paths: list[Path]) -> dict[str, list[str]]:
    fired: dict[str, list[str]] = {}
    for path in paths:
        if path.exists():
            for line in path.read_text().splitlines():
                timer_id, _ = line.split(" ")
                fired.setdefault(timer_id, []).append(path.name)
    return fired


def _stop(processes) -> None:
    for p in processes:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)


def test_four_processes_fire_every_timer_exactly_once(redis_url, redis_client, prefix, tmp_path):
    store = TimerStore(redis_client, prefix)
    paths = [tmp_path / f"p{i}.log" for i in range(4)]
    procs = [
        ctx.Process(target=_serve_into_file, args=(redis_url, prefix, str(p), 10_000))
        for p in paths
    ]
    for p in procs:
        p.start()
    try:
        # Each child creates its file just before it starts its service: arm only once all
        # four are there, or a slow start (spawned imports) leaves one process all the work.
        wait_for(lambda: all(p.exists() for p in paths), 60, "four firing processes")
        start = now_ms() + 500
        ids = store.arm_many([(f"race{i}|t", start + (i * 7) % 1500, {}) for i in range(300)])
        wait_for(lambda: sum(map(len, _read_lines(paths).values())) >= 300, 40, "300 firings")
        time.sleep(0.3)  # a duplicate, if any, would land now
        fired = _read_lines(paths)
    finally:
        _stop(procs)
    assert set(fired) == set(ids)
    assert [k for k, v in fired.items() if len(v) != 1] == []
    assert len({name for v in fired.values() for name in v}) >= 2  # the work was shared
    assert store.pending() == 0 and store.in_flight() == 0


def test_a_killed_claimers_timers_fire_elsewhere_after_its_lease(redis_url, redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    lease_ms = 1500
    claimed = ctx.Event()
    # All due at once, so the victim claims all of them in one batch.
    due = now_ms() + 300
    ids = store.arm_many([(f"race{i}|hedge", due, {"i": i}) for i in range(20)])
    victim = ctx.Process(target=_claim_then_hang, args=(redis_url, prefix, lease_ms, claimed))
    victim.start()
    try:
        assert claimed.wait(20), "the victim never claimed"
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = now_ms()
    finally:
        _stop([victim])
    assert store.in_flight() == 20 and store.pending() == 0

    recorder = Recorder()
    service = TimerService(store, recorder, lease_ms=5000).start()
    try:
        wait_for(lambda: len(recorder.fired) >= 20, 20, "the dead claimer's timers")
    finally:
        service.stop()
    assert sorted(t.id for t, _ in recorder.fired) == sorted(ids)
    assert {t.deliveries for t, _ in recorder.fired} == {2}
    first_fire = min(at for _, at in recorder.fired)
    # Not before the dead claimer's lease ran out, and long before any visibility timeout.
    assert first_fire >= due + lease_ms - 50
    assert first_fire - killed_at < lease_ms + 10_000
    assert store.in_flight() == 0


def test_a_timer_outlives_the_process_that_armed_it(redis_url, redis_client, prefix):
    due = now_ms() + 300
    armer = ctx.Process(target=_arm_and_die, args=(redis_url, prefix, due))
    armer.start()
    armer.join(20)
    recorder = Recorder()
    service = TimerService(TimerStore(redis_client, prefix), recorder).start()
    try:
        wait_for(lambda: recorder.fired, 20, "the orphan timer")
    finally:
        service.stop()
    (timer, at), *_ = recorder.fired
    assert timer.payload == {"from": "dead armer"} and at >= due


def test_service_fires_in_due_order_and_on_time(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    recorder = Recorder()
    service = TimerService(store, recorder).start()
    try:
        base = now_ms() + 300
        offsets = [(i * 37) % 400 for i in range(40)]  # distinct, armed out of order
        store.arm_many([(f"race{i}|t", base + off, {}) for i, off in enumerate(offsets)])
        wait_for(lambda: len(recorder.fired) >= 40, 20, "40 firings")
    finally:
        service.stop()
    dues = [t.due_ms for t, _ in recorder.fired]
    assert dues == sorted(dues)
    lags = [at - t.due_ms for t, at in recorder.fired]
    assert min(lags) >= 0
    assert max(lags) < 1000  # typically a few ms


def test_arming_an_earlier_timer_wakes_a_sleeping_service(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    store.arm("race|far", now_ms() + 60_000, {})
    recorder = Recorder()
    # It re-reads only every 8 s, so firing much sooner proves the wake-up message worked.
    service = TimerService(store, recorder, idle_ms=8000).start()
    try:
        channel = store.keys.channel
        wait_for(lambda: redis_client.pubsub_numsub(channel)[0][1] == 1, 10, "the subscription")
        time.sleep(0.2)  # let the service go to sleep on the far timer
        due = now_ms() + 100
        store.arm("race|near", due, {})
        wait_for(lambda: recorder.fired, 7, "the near timer")
    finally:
        service.stop(timeout=10)
    (timer, at), *_ = recorder.fired
    assert timer.key == "race|near"
    assert at - due < 3000


def test_polling_only_service_fires_on_time(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    recorder = Recorder()
    service = TimerService(store, recorder, use_pubsub=False).start()
    try:
        due = now_ms() + 200
        store.arm("race|hedge", due, {})
        wait_for(lambda: recorder.fired, 10, "the timer")
    finally:
        service.stop()
    (_, at), *_ = recorder.fired
    assert 0 <= at - due < 1000


def test_failing_handler_gets_the_timer_again_after_the_lease(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    calls: list[tuple[int, int, int]] = []

    def flaky(timer: Timer) -> None:
        calls.append((timer.deliveries, now_ms(), timer.lease_deadline_ms))
        if timer.deliveries == 1:
            raise RuntimeError("provider API hiccup")

    service = TimerService(store, flaky, lease_ms=400).start()
    try:
        store.arm("race|cutover", now_ms(), {})
        wait_for(lambda: len(calls) >= 2, 15, "the redelivery")
        wait_for(lambda: store.in_flight() == 0, 5, "the ack")
    finally:
        service.stop()
    assert [d for d, _, _ in calls] == [1, 2]
    assert calls[1][1] >= calls[0][2]  # not before the failed delivery's lease ran out
    assert service.failed == 1 and service.fired == 1


def test_handler_that_always_fails_is_dropped_after_max_deliveries(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    calls: list[int] = []

    def broken(timer: Timer) -> None:
        calls.append(timer.deliveries)
        raise RuntimeError("bug")

    service = TimerService(store, broken, lease_ms=200, max_deliveries=3).start()
    try:
        store.arm("race|safety", now_ms(), {})
        wait_for(lambda: len(calls) >= 3 and store.in_flight() == 0, 15, "the drop")
        time.sleep(0.5)
    finally:
        service.stop()
    assert calls == [1, 2, 3]
    assert store.pending() == 0


def test_service_survives_a_redis_outage(private_redis):
    import subprocess

    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    store = TimerStore(client, "outage")
    recorder = Recorder()
    service = TimerService(store, recorder).start()
    replacement = None
    try:
        store.arm("race|before", now_ms() + 100, {})
        wait_for(lambda: recorder.fired, 10, "the first timer")
        private_redis.process.kill()  # Redis dies (nothing persisted)
        private_redis.process.wait(5)
        time.sleep(0.5)
        assert service.alive
        replacement = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(private_redis.port),
             "--save", "", "--appendonly", "no", "--dir", private_redis.workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for(lambda: _answers(client), 10, "the new redis-server")
        store.arm("race|after", now_ms() + 100, {})
        wait_for(lambda: len(recorder.fired) >= 2, 15, "a timer after the outage")
    finally:
        service.stop()
        if replacement is not None:
            replacement.kill()
            replacement.wait(5)
    assert [t.key for t, _ in recorder.fired] == ["race|before", "race|after"]
    assert service.alive is False and service.last_error is not None


def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


# -- threads > 1: handlers on a bounded pool of worker threads ------------------------------


def test_pooled_service_fires_a_burst_concurrently_each_once(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    recorder = Recorder()

    def slow(timer: Timer) -> None:
        time.sleep(0.05)  # a race step waiting on Redis round trips
        recorder(timer)

    service = TimerService(store, slow, threads=8).start()
    try:
        due = now_ms() + 200
        ids = store.arm_many([(f"race{i}|hedge", due, {}) for i in range(80)])
        wait_for(lambda: len(recorder.fired) >= 80, 15, "80 firings")
        wait_for(lambda: store.in_flight() == 0, 5, "the acks")
    finally:
        service.stop()
    # Serially 80 x 50 ms is 4 s; eight at a time it is about 0.5 s.
    assert max(at for _, at in recorder.fired) - due < 2000
    assert sorted(t.id for t, _ in recorder.fired) == sorted(ids)  # each exactly once
    assert {t.deliveries for t, _ in recorder.fired} == {1}
    assert service.fired == 80 and service.failed == 0
    assert store.pending() == 0


def test_pooled_service_redelivers_a_failure_and_drops_it_after_max_deliveries(
    redis_client, prefix
):
    store = TimerStore(redis_client, prefix)
    calls: dict[str, list[tuple[int, int, int]]] = {"bad": [], "flaky": []}
    lock = threading.Lock()

    def handler(timer: Timer) -> None:
        with lock:
            calls[timer.key].append((timer.deliveries, now_ms(), timer.lease_deadline_ms))
        if timer.key == "bad" or timer.deliveries == 1:
            raise RuntimeError("provider API hiccup")

    service = TimerService(store, handler, threads=4, lease_ms=300, max_deliveries=3).start()
    try:
        store.arm_many([("bad", now_ms(), {}), ("flaky", now_ms(), {})])
        wait_for(lambda: len(calls["bad"]) >= 3 and len(calls["flaky"]) >= 2, 15, "redeliveries")
        wait_for(lambda: store.in_flight() == 0, 5, "the ack and the drop")
    finally:
        service.stop()
    assert [d for d, _, _ in calls["bad"]] == [1, 2, 3]
    assert [d for d, _, _ in calls["flaky"]] == [1, 2]
    for seen in calls.values():
        for (_, _, lease_end), (_, at, _) in zip(seen, seen[1:], strict=False):
            assert at >= lease_end  # not before the failed delivery's lease ran out
    assert store.pending() == 0  # nothing left in Redis: the dropped timer cannot come back
    assert service.failed == 4 and service.fired == 1


def test_pooled_stop_waits_for_running_handlers_and_starts_no_more(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    started: list[int] = []
    finished: list[int] = []
    lock = threading.Lock()

    def handler(timer: Timer) -> None:
        with lock:
            started.append(now_ms())
        time.sleep(0.3)
        with lock:
            finished.append(now_ms())

    service = TimerService(store, handler, threads=4).start()
    store.arm_many([(f"race{i}|t", now_ms(), {}) for i in range(20)])
    wait_for(lambda: len(started) >= 4, 10, "four running handlers")
    stop_called = now_ms()
    service.stop(timeout=5)
    stop_returned = now_ms()
    assert not service.alive
    wait_for(lambda: not any(w.is_alive() for w in service._workers), 5, "the workers to exit")
    assert started and max(started) <= stop_called  # none started after stop()
    assert len(finished) == len(started)  # stop() waited for every running handler...
    assert max(finished) <= stop_returned
    assert service.running == 0
    # ...and acknowledged them; the rest is left in Redis for another process.
    assert store.pending() + store.in_flight() == 20 - len(finished)


def test_pooled_stop_is_bounded_by_its_timeout(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    release = threading.Event()
    entered = threading.Event()

    def hang(timer: Timer) -> None:
        entered.set()
        release.wait(30)

    service = TimerService(store, hang, threads=2).start()
    try:
        store.arm("race|hang", now_ms(), {})
        assert entered.wait(10), "the handler never ran"
        began = time.monotonic()
        service.stop(timeout=0.3)
        assert time.monotonic() - began < 2.0
        assert not service.alive
    finally:
        release.set()


def test_pooled_service_never_has_more_than_threads_in_flight(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    threads = 3
    lock = threading.Lock()
    active = 0
    peak_active = 0
    peak_claimed = 0
    done: list[str] = []

    def handler(timer: Timer) -> None:
        nonlocal active, peak_active, peak_claimed
        with lock:
            active += 1
            peak_active = max(peak_active, active)
        claimed = store.in_flight()  # claimed and not yet acknowledged, in Redis
        time.sleep(0.02)
        with lock:
            active -= 1
            peak_claimed = max(peak_claimed, claimed)
            done.append(timer.id)

    service = TimerService(store, handler, threads=threads).start()
    try:
        store.arm_many([(f"race{i}|t", now_ms(), {}) for i in range(30)])
        wait_for(lambda: len(done) >= 30, 15, "30 firings")
    finally:
        service.stop()
    assert peak_active == threads  # the pool was used in full, and never more
    # Claims follow free slots: with batch=200 all 30 would be claimed at once otherwise. Redis
    # also counts finished timers whose acknowledgement waits for the next claim: at most one
    # per slot since the last claim.
    assert 1 <= peak_claimed <= 2 * threads


class CountingStore(TimerStore):
    """A TimerStore that counts its claims, the acknowledgements and cancels they carried, and
    ack_many."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.claims = self.acked_by_claims = self.ack_calls = 0
        self.cancel_rounds: list[tuple[int, int]] = []  # (limit, cancels) of claims with some

    def claim(self, now_ms, limit=100, *args, acks=(), cancels=(), **kwargs):
        acks, cancels = list(acks), list(cancels)
        self.claims += 1
        self.acked_by_claims += len(acks)
        if cancels:
            self.cancel_rounds.append((limit, len(cancels)))
        return super().claim(now_ms, limit, *args, acks=acks, cancels=cancels, **kwargs)

    def ack_many(self, timers):
        self.ack_calls += 1
        return super().ack_many(timers)


def test_pooled_acknowledgements_ride_in_the_next_claim(redis_client, prefix):
    store = CountingStore(redis_client, prefix)
    recorder = Recorder()

    def handler(timer: Timer) -> None:
        time.sleep(0.01)
        recorder(timer)

    service = TimerService(store, handler, threads=4).start()
    try:
        ids = store.arm_many([(f"race{i}|t", now_ms() + i * 5, {}) for i in range(60)])
        wait_for(lambda: len(recorder.fired) >= 60, 15, "60 firings")
        wait_for(lambda: store.in_flight() == 0, 5, "the acknowledgements")
    finally:
        service.stop()
    assert sorted(t.id for t, _ in recorder.fired) == sorted(ids)
    # every acknowledgement went out inside a claim: no round trip of its own
    assert store.acked_by_claims == 60 and store.ack_calls == 0, vars(store)


def test_a_lone_acknowledgement_rides_in_the_next_claim_and_stop_sends_what_waits(
    redis_client, prefix
):
    store = CountingStore(redis_client, prefix)
    recorder = Recorder()
    service = TimerService(store, recorder, threads=2, ack_delay_ms=300).start()
    try:
        store.arm("race1|t", now_ms(), {})
        wait_for(lambda: recorder.fired, 5, "the firing")
        # nothing else is due: it rides in the service's next idle claim (every idle_ms) or in
        # the claim its delay calls for, whichever comes first; never in a round trip of its own
        wait_for(lambda: store.in_flight() == 0, 5, "the acknowledgement")
        assert store.acked_by_claims == 1 and store.ack_calls == 0
    finally:
        service.stop()
    # a service that claims again only after 10 s: the acknowledgement waits until stop
    # (a delay of 19 s: a loaded machine may hold this thread up for seconds)
    slow = TimerService(
        store, recorder, threads=2, idle_ms=20_000, lease_ms=20_000, ack_delay_ms=19_000
    ).start()
    try:
        store.arm("race2|t", now_ms(), {})
        wait_for(lambda: len(recorder.fired) == 2, 5, "the second firing")
        time.sleep(0.1)
        assert store.in_flight() == 1  # fired, its acknowledgement still waiting
    finally:
        slow.stop()
    assert store.in_flight() == 0 and store.pending() == 0  # stop sent it


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_threads_below_one_or_not_an_int_is_rejected(redis_client, prefix, threads):
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        TimerService(TimerStore(redis_client, prefix), lambda t: None, threads=threads)


# -- look-ahead: one claim for a window of timers, each still fired at its due time ----------


def test_timers_claimed_ahead_fire_at_their_due_time_never_before(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    recorder = Recorder()
    claims = []
    real_claim = store.claim

    def counting_claim(*args, **kwargs):
        claims.append(args)
        return real_claim(*args, **kwargs)

    store.claim = counting_claim
    service = TimerService(store, recorder, threads=4, ahead_ms=50).start()
    try:
        time.sleep(0.3)  # idle re-reads settle
        base = now_ms() + 300
        dues = [base + 7 * i for i in range(8)]  # eight timers within 50 ms
        store.arm_many([(f"race{i}|t", due, {}) for i, due in enumerate(dues)])
        wait_for(lambda: len(recorder.fired) >= 8, 10, "eight firings")
        during = [c for c in claims if base - 5 <= c[0] <= dues[-1]]
    finally:
        service.stop()
    fired = {t.due_ms: at for t, at in recorder.fired}
    assert sorted(fired) == dues
    assert all(at >= due for due, at in fired.items())  # never early...
    assert max(at - due for due, at in fired.items()) < 500  # ...and on time (loaded machine)
    assert len(during) <= 3, during  # not one claim per timer


def test_two_services_with_look_ahead_fire_each_timer_once(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    recorder = Recorder()
    services = [TimerService(store, recorder, threads=4, ahead_ms=20).start() for _ in range(2)]
    try:
        base = now_ms() + 200
        ids = store.arm_many([(f"race{i}|t", base + 3 * i, {}) for i in range(60)])
        wait_for(lambda: len(recorder.fired) >= 60, 15, "sixty firings")
        time.sleep(0.2)
    finally:
        for service in services:
            service.stop()
    assert sorted(t.id for t, _ in recorder.fired) == sorted(ids)
    assert all(at >= t.due_ms for t, at in recorder.fired)


def test_stop_gives_timers_held_ahead_back_for_anyone(redis_client, prefix):
    store = TimerStore(redis_client, prefix)
    recorder = Recorder()
    service = TimerService(store, recorder, threads=2, ahead_ms=5000).start()
    due = now_ms() + 2000
    store.arm("race|later", due, {})
    wait_for(lambda: store.in_flight() == 1, 5, "the timer held ahead")
    service.stop(timeout=5)
    assert recorder.fired == [] and service.running == 0
    assert store.pending() == 1 and store.in_flight() == 0
    assert store.claim(due - 1, 10, 1000).timers == []  # waiting again, until its due time
    (again,) = store.claim(due, 10, 1000).timers
    assert again.deliveries == 1


def test_look_ahead_needs_a_pool_of_threads(redis_client, prefix):
    with pytest.raises(ValueError, match="ahead_ms"):
        TimerService(TimerStore(redis_client, prefix), lambda t: None, ahead_ms=10)


def test_deferred_cancels_ride_in_the_services_next_claim_and_go_at_once_without_one(
    redis_client, prefix
):
    store = CountingStore(redis_client, prefix)
    far = now_ms() + 600_000
    ids = [
        store.arm(f"race{i}|deadline", far, {}, timer_id=f"race{i}|deadline|1") for i in range(3)
    ]
    store.defer_cancels(ids[:1])  # no service here: one round trip of its own, at once
    assert store.cancel_rounds == [(0, 1)] and store.pending() == 2
    recorder = Recorder()
    service = TimerService(store, recorder, threads=2).start()
    try:
        store.defer_cancels(ids[1:])
        store.arm("wake|t", now_ms(), {})  # something due: the service claims
        wait_for(lambda: store.pending() == 0 and recorder.fired, 5, "the cancels and the firing")
        # they rode in a claim that also looked for due timers (limit > 0)
        assert any(limit > 0 and n == 2 for limit, n in store.cancel_rounds), store.cancel_rounds
    finally:
        service.stop()
    assert not store.claims_carry_cancels  # stopped: back to cancelling at once
