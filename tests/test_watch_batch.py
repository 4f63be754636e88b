"""The batched watch loop (``race/watch_batch.py``) on a real redis-server.

A batch of due watch polls is polled, stepped in memory and saved in one round trip; what it
cannot finish (a job that ended, a step that does more than arm timers, a save that lost its
version check) is handed back with the work to do, and the race ends the same as on the
per-timer path. The timer service's side (acknowledging a batch, firing what it hands back) is
at the end.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis.connection

from gpuhedge_celery.core.attempts import Phase
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.race.base import RaceParts
from gpuhedge_celery.race.driver import RaceDriver
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.race.watch_batch import WatchBatch
from gpuhedge_celery.store.timer_service import TimerService, TimerServices
from gpuhedge_celery.store.timers import TimerStore
from tests.support.waiting import wait_for
from tests.test_races_driver import Recorder, build_driver, race_stores

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]

QUEUED_THEN_RUNS = {"sim": {"p": {"queue_s": 2, "run_s": 100}}}  # 20 ms queued, then 1 s
ENDS_SOON = {"sim": {"p": {"queue_s": 0, "run_s": 5}}}  # done 50 ms after its submit


@pytest.fixture
def setup(redis_client, prefix):
    return build_driver(redis_client, prefix, Recorder())


def start(driver, cfg, race_ids, request=QUEUED_THEN_RUNS, policy="hedge:p->h@60s"):
    """Create and submit each race; its first poll is made, the next armed (no hedge comes
    soon: these effects only record launches)."""
    for race_id in race_ids:
        driver.create(race_id, request, build_spec(cfg, policy=policy))
        driver.submit_attempt(race_id, "a1")


def claim_watches(driver, count, timeout=5.0):
    """Claim due watch timers until ``count`` are held (others are left alone)."""
    held = []

    def enough():
        now = int(driver.clock.now() * 1000)
        for timers in driver.timers.stores:  # every race shard's
            for timer in timers.claim(now, 100, 10_000).timers:
                if timer.payload["kind"] == "watch":
                    held.append(timer)
        return len(held) >= count

    wait_for(enough, timeout, f"{count} due watch timers")
    return held


def watch_timers(driver, race_id):
    """The ids of the race's armed watch timers (one per watched job, never two)."""
    timers = driver.timers.of(race_id)
    return [t for t in timers.client.zrange(timers.keys.due, 0, -1) if f"{race_id}:w:" in t]


def handled(batch, timers):
    """Run one batch; the timers it handed back, each with its work, in order."""
    back = []
    batch.handle(timers, lambda timer, work: back.append((timer, work)))
    return back


class RoundTrips:
    """Counts the requests redis-py sends (a command or a whole pipeline is one; a new
    connection's greeting is none of the store's), and where the sim ledger's batched reads
    (``MGET``) went."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.reads: list[tuple[str, int]] = []
        send = redis.connection.Connection.send_packed_command
        greet = redis.connection.Connection.on_connect_check_health
        greeting: set[int] = set()

        def greeted(conn, *args, **kwargs):
            greeting.add(id(conn))
            try:
                return greet(conn, *args, **kwargs)
            finally:
                greeting.discard(id(conn))

        def counted(conn, command, *args, **kwargs):
            if id(conn) in greeting:
                return send(conn, command, *args, **kwargs)
            self.count += 1
            first = command if isinstance(command, bytes | str) else command[0]
            head = bytes(first[:64], "utf-8") if isinstance(first, str) else bytes(first[:64])
            if head.split(b"\r\n")[2:3] == [b"MGET"]:
                self.reads.append((conn.host, conn.port))
            return send(conn, command, *args, **kwargs)

        monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)
        monkeypatch.setattr(redis.connection.Connection, "on_connect_check_health", greeted)

    def ledger_reads(self, on_cluster: bool) -> int:
        """The sim ledger's batched read: one round trip on one Redis; on a Redis Cluster, whose
        MGET keeps to one slot, one per node holding the jobs' keys (a node's slots pipelined)."""
        assert self.reads and len(self.reads) == (len(set(self.reads)) if on_cluster else 1)
        return len(self.reads)


def test_a_batch_of_polls_is_stepped_and_saved_in_one_round_trip(setup, monkeypatch, on_cluster):
    driver, effects, cfg, _, _ = setup
    races = [f"b{i}" for i in range(12)]
    versions, timers = started_and_due(driver, cfg, races)
    trips = RoundTrips(monkeypatch)
    batch = WatchBatch(driver)
    assert handled(batch, timers) == []  # nothing handed back
    # the sim's ledger read for all twelve polls, then every save, heartbeat and next arm (a
    # pipeline per race shard)
    assert trips.count == trips.ledger_reads(on_cluster) + shards_of(driver, races)
    for r in races:
        record = driver.store.load(r)
        assert record.version == versions[r] + 1
        assert record.state["race"]["attempts"][0]["phase"] == Phase.RUNNING.value
        assert len(watch_timers(driver, r)) == 1  # the next poll, once
    assert effects.events.count("running") == len(races)
    assert (batch.batches, batch.polls) == (1, len(races))


def shards_of(driver, races) -> int:
    """How many race shards ``races`` are on (a batch writes one pipeline per shard)."""
    return len({driver.timers.shards.tag_of(r) for r in races})


def started_and_due(driver, cfg, races):
    """Start the races; their versions, and their first polls claimed once due."""
    start(driver, cfg, races)
    versions = {r: driver.store.load(r).version for r in races}
    return versions, claim_watches(driver, len(races))


def _assert_stepped_once(driver, effects, races, versions):
    for r in races:
        assert driver.store.load(r).version == versions[r] + 1  # one save, not two
        assert len(watch_timers(driver, r)) == 1  # one next poll: no second chain
    assert effects.events.count("running") == len(races)  # each report's event, once


def test_a_batch_whose_answer_was_lost_is_sent_again_with_the_same_ids(setup, monkeypatch):
    import gpuhedge_celery.race.watch_batch as wb

    driver, effects, cfg, _, _ = setup
    races = ["l1", "l2", "l3"]
    versions, timers = started_and_due(driver, cfg, races)
    real, calls = wb.run_pipeline, []

    def lost_once(*args, **kwargs):  # it reaches Redis, then the answer is lost
        replies = real(*args, **kwargs)
        calls.append(len(replies))
        if len(calls) == 1:
            raise redis.ConnectionError("connection reset by peer")
        return replies

    monkeypatch.setattr(wb, "run_pipeline", lost_once)
    monkeypatch.setattr(wb, "WRITE_RETRY_INTERVAL_S", 0.01)
    assert handled(WatchBatch(driver), timers) == []
    # sent again: the saves answer "saved" (their ids), not a conflict
    assert len(calls) == 1 + shards_of(driver, races)
    _assert_stepped_once(driver, effects, races, versions)


def test_scripts_missing_in_redis_are_loaded_and_the_same_saves_sent_again(setup, redis_client):
    driver, effects, cfg, _, _ = setup
    races = ["n1", "n2"]
    versions, timers = started_and_due(driver, cfg, races)
    # Redis restarted, say: it knows the save script again but not the arm script yet, so the
    # first send saves, its arms fail NOSCRIPT, and the whole pipeline is sent once more
    redis_client.script_flush()
    redis_client.script_load(driver.store.save_script.script)
    assert handled(WatchBatch(driver), timers) == []
    _assert_stepped_once(driver, effects, races, versions)


def test_a_batch_redis_will_not_take_is_written_race_by_race_on_the_threads(setup, monkeypatch):
    driver, effects, cfg, _, _ = setup
    races = ["w1", "w2"]
    versions, timers = started_and_due(driver, cfg, races)
    batch = WatchBatch(driver)
    monkeypatch.setattr(batch, "_send", lambda *args: None)  # gave up (Redis unreachable)
    back = handled(batch, timers)
    assert [t for t, _ in back] == timers and all(callable(work) for _, work in back)
    assert all(driver.store.load(r).version == versions[r] for r in races)  # nothing yet
    for _, work in back:  # the timer threads: each race's part alone, the same ids
        work()
    _assert_stepped_once(driver, effects, races, versions)


def test_unchanged_polls_only_refresh_the_heartbeat_and_re_arm(setup, monkeypatch, on_cluster):
    driver, _, cfg, _, _ = setup
    start(driver, cfg, ["u1", "u2"])
    versions = {r: driver.store.load(r).version for r in ("u1", "u2")}
    # polls that already saw the job running last time (their jobs run now: nothing new)
    timers = [
        type(t)(**{**t.__dict__, "payload": {**t.payload, "last": JobState.IN_PROGRESS.value}})
        for t in claim_watches(driver, 2)
    ]
    trips = RoundTrips(monkeypatch)
    assert handled(WatchBatch(driver), timers) == []
    assert trips.count == trips.ledger_reads(on_cluster) + shards_of(driver, ["u1", "u2"])
    for r in ("u1", "u2"):
        assert driver.store.load(r).version == versions[r]  # nothing saved
        assert len(watch_timers(driver, r)) == 1  # the next poll, at the job's end


def test_a_job_that_ended_is_handed_back_to_be_concluded(setup):
    driver, effects, cfg, _, _ = setup
    start(driver, cfg, ["e1"], ENDS_SOON)
    (timer,) = claim_watches(driver, 1)
    back = handled(WatchBatch(driver), [timer])
    assert [t for t, _ in back] == [timer] and callable(back[0][1])
    assert effects.results == []
    back[0][1]()  # what the timer thread runs for it: result, validation, the winner
    assert [r["winner"] for r in effects.results] == ["p"]
    assert driver.store.receipt("e1")["finished"] is True


def test_a_save_that_lost_its_version_check_is_stepped_again_from_redis(
    setup, redis_client, prefix, monkeypatch
):
    driver, effects, cfg, _, providers = setup
    start(driver, cfg, ["c1"])
    (timer,) = claim_watches(driver, 1)
    # another process saves the race after this one did: its copy here is now stale
    other = RaceDriver(RaceParts(
        *race_stores(redis_client, prefix),
        providers.__getitem__, Recorder(), RaceSettings(),
    ))  # fmt: skip
    other.store.update("c1", lambda state: {**state, "note": "moved on"})
    assert driver.store.cached("c1").version < driver.store.load("c1").version
    back = handled(WatchBatch(driver), [timer])
    assert [t for t, _ in back] == [timer] and callable(back[0][1])
    reads, load = [], driver.store.load

    def counted(race_id, *, fresh=False):
        found = load(race_id, fresh=fresh)
        if found is not None and not found.cached:
            reads.append(race_id)
        return found

    monkeypatch.setattr(driver.store, "load", counted)
    back[0][1]()
    assert reads == []  # stepped from the state the refused save was answered with
    monkeypatch.undo()
    state = driver.store.load("c1").state
    assert state["note"] == "moved on"  # the other process's save is kept
    assert state["race"]["attempts"][0]["phase"] == Phase.RUNNING.value  # and the poll's
    assert len(watch_timers(driver, "c1")) == 1  # its next poll armed once, in the batch


def test_other_timer_kinds_and_redeliveries_are_handed_back_untouched(setup):
    driver, _, cfg, _, _ = setup
    start(driver, cfg, ["o1", "o2"])
    first, second = claim_watches(driver, 2)
    redelivered = type(second)(**{**second.__dict__, "deliveries": 2})
    policy = type(first)(**{**first.__dict__, "payload": {"race": "o1", "kind": "policy",
                                                          "key": "hedge"}})  # fmt: skip
    back = handled(WatchBatch(driver), [policy, redelivered])
    assert back == [(policy, None), (redelivered, None)]


def test_a_finished_race_arms_no_more_polls_for_its_ended_jobs(setup):
    driver, _, cfg, _, _ = setup
    start(driver, cfg, ["f1"])
    (timer,) = claim_watches(driver, 1)
    driver.step("f1", lambda race: None)  # nothing; then the race is finished by hand:
    driver.store.update("f1", _finish_by_hand)
    assert handled(WatchBatch(driver), [timer]) == []
    assert watch_timers(driver, "f1") == []


def _finish_by_hand(state):
    for a in state["race"]["attempts"]:
        a["phase"] = Phase.ENDED.value
    state["race"]["finished"] = True
    return state


def test_polls_claimed_by_a_process_that_died_are_finished_elsewhere(setup, redis_client, prefix):
    driver, _, cfg, _, providers = setup
    races = ["d1", "d2", "d3"]
    start(driver, cfg, races, {"sim": {"p": {"queue_s": 2, "run_s": 10}}})
    # a process claims the due polls with a 300 ms lease, then dies before handling them
    time.sleep(0.05)
    now = int(driver.clock.now() * 1000)
    lost = [t for timers in driver.timers.stores for t in timers.claim_due(now, 100, 300)
            if t.payload["kind"] == "watch"]  # fmt: skip
    assert len(lost) == len(races)
    # another process (no copy of any race) runs the batched loop
    effects = Recorder()
    other = RaceDriver(RaceParts(
        *race_stores(redis_client, prefix),
        providers.__getitem__, effects, RaceSettings(),
    ))  # fmt: skip
    batch, redelivered = WatchBatch(other), []

    def handle(due, hand_back):
        def recording(timer, work):
            if timer.deliveries > 1:
                redelivered.append(timer.id)
            hand_back(timer, work)

        batch.handle(due, recording)

    service = TimerServices(other.timers, other.on_timer, threads=4, batch_handler=handle)
    service.start()
    try:
        # (a redelivered timer also resumes its race: the same result may be marked twice)
        won = lambda: {r["race_id"] for r in effects.results} == set(races)  # noqa: E731
        wait_for(won, 20, "every race won elsewhere")
    finally:
        service.stop()
    assert sorted(redelivered) == sorted(t.id for t in lost)  # handed to the per-timer path
    for r in races:
        assert driver.store.receipt(r)["winner"] == "a1"


def test_the_timer_service_acknowledges_a_batch_and_fires_what_it_hands_back(redis_client, prefix):
    timers = TimerStore(redis_client, prefix, "batch")
    now = int(time.time() * 1000)
    for i in range(6):
        timers.arm(f"k{i}", now, {"n": i})
    fired, lock = [], threading.Lock()

    def handler(timer):  # the per-timer path
        with lock:
            fired.append(("handler", timer.payload["n"]))

    def batch(due, hand_back):
        for timer in due:
            n = timer.payload["n"]
            if n % 3 == 1:
                hand_back(timer, None)
            elif n % 3 == 2:
                hand_back(timer, lambda n=n: fired.append(("work", n)))

    service = TimerService(timers, handler, threads=2, batch_handler=batch).start()
    try:
        wait_for(lambda: len(fired) == 4, 10, "the handed-back timers fired")
        wait_for(lambda: timers.pending() + timers.in_flight() == 0, 10, "all acknowledged")
    finally:
        service.stop()
    assert sorted(fired) == [("handler", 1), ("handler", 4), ("work", 2), ("work", 5)]
    assert service.fired == 6 and service.failed == 0


def test_a_batch_handler_that_raises_leaves_every_timer_to_the_threads(redis_client, prefix):
    timers = TimerStore(redis_client, prefix, "batch")
    now = int(time.time() * 1000)
    for i in range(4):
        timers.arm(f"k{i}", now, {"n": i})
    fired = []

    def broken(due, hand_back):
        hand_back(due[0], None)  # one handed back before it fails: fired once, not twice
        raise RuntimeError("boom")

    service = TimerService(timers, lambda t: fired.append(t.payload["n"]), threads=2,
                           batch_handler=broken).start()  # fmt: skip
    try:
        wait_for(lambda: len(fired) == 4, 10, "every timer fired one by one")
        wait_for(lambda: timers.pending() + timers.in_flight() == 0, 10, "all acknowledged")
    finally:
        service.stop()
    assert sorted(fired) == [0, 1, 2, 3]


def test_a_batched_claim_takes_a_few_timers_per_free_thread(redis_client, prefix):
    # A claim takes at most BATCH_PER_SLOT timers per free thread; what the batch hands back
    # queues for the threads, and a timer that waited there until its lease was nearly spent
    # goes back to Redis unfired: never fired by two claims (its lease lapsed while queued).
    from gpuhedge_celery.store.timer_workers import BATCH_PER_SLOT

    timers = TimerStore(redis_client, prefix, "batch")
    now = int(time.time() * 1000)
    for i in range(30):
        timers.arm(f"k{i}", now, {"n": i})
    sizes, fired = [], []

    def all_back(due, hand_back):
        sizes.append(len(due))
        for timer in due:
            hand_back(timer, None)

    def slow(timer):  # eight queued behind two threads wait about 0.45 s: past 3/4 of 0.4 s
        fired.append(timer)
        time.sleep(0.15)

    service = TimerService(timers, slow, threads=2, lease_ms=400, ack_delay_ms=10,
                           batch_handler=all_back).start()  # fmt: skip
    try:
        wait_for(lambda: len(fired) >= 30, 30, "every timer fired")
        wait_for(lambda: timers.pending() + timers.in_flight() == 0, 10, "all acknowledged")
    finally:
        service.stop()
    assert max(sizes) <= 2 * BATCH_PER_SLOT, sizes
    assert sum(sizes) > 30  # some went back unfired and were claimed again
    assert sorted(t.payload["n"] for t in fired) == list(range(30))  # each fired once
    assert all(t.deliveries == 1 for t in fired)  # never taken again after a lapsed lease


def test_a_batch_handler_needs_a_pool(redis_client, prefix):
    with pytest.raises(ValueError, match="threads > 1"):
        TimerService(TimerStore(redis_client, prefix, "b"), print, batch_handler=lambda d, b: None)
