"""Timer coordinators: the pure deal of race shards over live coordinators (a table, no
server), the registry of their leases on a real redis-server, and coordinators that join,
stop and die while every shard's timers keep firing once."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter

import pytest
import redis

from gpuhedge_celery.core.shard_deal import dealt_shards, helped_shards
from gpuhedge_celery.store.race_keys import RaceShards, shard_of
from gpuhedge_celery.store.timer_coordinators import HELP_BEHIND_MS, Coordinators
from gpuhedge_celery.store.timer_service import TimerServices
from gpuhedge_celery.store.timers import RaceTimers, Timer
from tests.support.redis_server import free_port
from tests.support.waiting import wait_for

BEAT = {"beat_ms": 100, "coordinator_lease_ms": 400}  # a deal settles within a second here


def deal(names: list[str], count: int) -> dict[str, tuple[int, ...]]:
    return {me: dealt_shards(me, names, count) for me in names}


@pytest.mark.parametrize(("n", "count"), list(itertools.product(range(1, 8), range(1, 8))))
def test_every_shard_is_claimed_and_the_work_is_spread_evenly(n, count):
    dealt = deal([f"c{i}" for i in range(n)], count)
    claimers = Counter(shard for shards in dealt.values() for shard in shards)
    assert set(claimers) == set(range(count))  # no shard left unclaimed
    assert all(dealt.values())  # no coordinator idle
    held = [len(shards) for shards in dealt.values()]
    assert max(held) - min(held) <= 1
    if n <= count:  # each shard has one claimer: a coordinator more is claims spread, not added
        assert set(claimers.values()) == {1}
    else:  # more coordinators than shards: each holds one, the shards' claimers differ by <= 1
        assert held == [1] * n and max(claimers.values()) - min(claimers.values()) <= 1


@pytest.mark.parametrize(("n", "count"), list(itertools.product(range(1, 8), range(1, 8))))
def test_each_shard_with_one_holder_has_one_helper_and_helping_grows_with_shards(n, count):
    names = [f"c{i}" for i in range(n)]
    held = deal(names, count)
    helped = {me: helped_shards(me, names, count) for me in names}
    holders = Counter(shard for shards in held.values() for shard in shards)
    helpers = Counter(shard for shards in helped.values() for shard in shards)
    for shard in range(count):
        alone = holders[shard] == 1 and n > 1
        assert helpers[shard] == (1 if alone else 0)  # helped where nobody else claims it
    for me in names:
        assert not set(helped[me]) & set(held[me])  # never a shard it holds
    assert sum(helpers.values()) <= count  # polls grow with shards, not with n x shards


def test_with_one_shard_every_coordinator_claims_it():
    assert deal(["a", "b", "c"], 1) == {"a": (0,), "b": (0,), "c": (0,)}


def test_the_deal_is_the_same_whatever_order_the_registry_lists():
    names = ["w1", "w3", "w2", "w0"]
    assert deal(names, 6) == deal(sorted(names, reverse=True), 6)


def test_a_coordinator_missing_from_the_list_still_claims_its_part():
    assert dealt_shards("lapsed", ["a", "b"], 3) == dealt_shards("lapsed", ["a", "b", "lapsed"], 3)


@pytest.mark.parametrize("count", [0, -1, True, 1.5])
def test_a_shard_count_that_is_not_a_whole_number_is_refused(count):
    with pytest.raises(ValueError, match="shard count must be a whole number"):
        dealt_shards("a", ["a"], count)


@pytest.mark.cluster
def test_the_registry_lists_live_coordinators_and_forgets_lapsed_ones(redis_client, prefix):
    registry = Coordinators(redis_client, prefix)
    assert registry.beat("b", 5_000) == ["b"]
    assert registry.beat("a", 150) == ["a", "b"]
    assert registry.live() == ["a", "b"]
    time.sleep(0.3)  # a's lease lapses
    assert registry.live() == ["b"]
    assert registry.beat("b", 5_000) == ["b"]
    assert 0 < redis_client.ttl(registry.key) <= 20  # it does not outlive its members for long
    assert registry.leave("b") == []
    with pytest.raises(ValueError, match="lease must be >= 1 ms"):
        registry.beat("b", 0)


class Firing:
    """Race timers on ``count`` shards and a handler that records which coordinator fired each."""

    def __init__(self, client, prefix: str, count: int):
        self.timers = RaceTimers(client, RaceShards(prefix, count=count))
        self.count = count
        self.fired: list[tuple[str, str]] = []  # (coordinator, timer id)
        self._lock = threading.Lock()
        self.coordinators: dict[str, TimerServices] = {}

    def join(self, me: str, hang: threading.Event | None = None, **options) -> TimerServices:
        def handler(timer: Timer) -> None:
            while hang is not None and hang.is_set():  # hangs until the test clears it
                time.sleep(0.02)
            with self._lock:
                self.fired.append((me, timer.id))

        options = {**BEAT, **options}
        services = TimerServices(self.timers, handler, me=me, threads=2, **options)
        self.coordinators[me] = services.start()
        return services

    def held(self) -> dict[str, tuple[int, ...]]:
        return {me: c.shards for me, c in self.coordinators.items() if not c._stop.is_set()}

    def settled(self) -> bool:
        """Every running coordinator holds exactly its dealt part, and no shard twice."""
        held = self.held()
        expected = deal(list(held), self.count)
        return held == expected

    def arm_on_every_shard(self, per_shard: int, tag: str) -> list[str]:
        due = int(time.time() * 1000) + 50
        armed = []
        for k in range(self.count):
            ids = [f"{tag}{i}" for i in range(500) if shard_of(f"{tag}{i}", self.count) == k]
            for race_id in ids[:per_shard]:
                store = self.timers.of(race_id)
                armed.append(store.arm(f"{race_id}:t", due, {"race": race_id}))
        return armed

    def fired_once(self, armed: list[str], timeout_s: float = 10) -> None:
        wait_for(lambda: {t for _, t in self.fired} >= set(armed), timeout_s, "every timer fired")
        ids = [t for _, t in self.fired if t in set(armed)]
        assert sorted(ids) == sorted(armed)  # once each

    def stop(self) -> None:
        for coordinator in self.coordinators.values():
            coordinator.stop()


def crash(coordinator: TimerServices) -> None:
    """Stop firing without ending the lease, as a killed process does."""
    coordinator.coordinators.leave = lambda me: []  # type: ignore[method-assign]
    coordinator._stop.set()
    for service in [*coordinator.services, *coordinator.helpers]:
        service.stop()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_coordinators_that_join_split_the_shards_and_fire_each_timer_once(redis_client, prefix):
    firing = Firing(redis_client, prefix, 3)
    try:
        firing.join("a")
        assert firing.held() == {"a": (0, 1, 2)}  # alone, it holds every shard at once
        firing.fired_once(firing.arm_on_every_shard(5, "x"))
        firing.join("b")
        firing.join("c")
        wait_for(firing.settled, 5, "the three share the three shards")
        assert sorted(firing.held().values()) == [(0,), (1,), (2,)]
        armed = firing.arm_on_every_shard(5, "y")
        firing.fired_once(armed)
        by_coordinator = Counter(me for me, t in firing.fired if t in set(armed))
        assert sorted(by_coordinator.values()) == [5, 5, 5]  # each fired its own shard's
    finally:
        firing.stop()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_dead_coordinator_s_shards_are_taken_once_its_lease_lapses(redis_client, prefix):
    firing = Firing(redis_client, prefix, 3)
    try:
        for me in ("a", "b"):
            firing.join(me)
        wait_for(firing.settled, 5, "a and b share the shards")
        dead = firing.coordinators["b"]
        lost = dead.shards
        crash(dead)
        started = time.monotonic()
        wait_for(lambda: firing.held()["a"] == (0, 1, 2), 5, "a takes b's shards")
        # no sooner than b's lease could lapse, less a beat of a's
        assert time.monotonic() - started >= BEAT["coordinator_lease_ms"] / 1000 - 0.25
        armed = firing.arm_on_every_shard(4, "z")
        firing.fired_once(armed)
        assert {me for me, t in firing.fired if t in set(armed)} == {"a"}
        assert lost  # b held a part before it died
    finally:
        firing.stop()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_coordinator_that_stops_hands_its_shards_over_at_the_next_beat(redis_client, prefix):
    firing = Firing(redis_client, prefix, 2)
    try:
        for me in ("a", "b"):
            firing.join(me)
        wait_for(firing.settled, 5, "a and b share the shards")
        firing.coordinators["b"].stop()
        assert Coordinators(redis_client, prefix).live() == ["a"]  # its lease ended with it
        wait_for(lambda: firing.held()["a"] == (0, 1), 2, "a takes b's shard within beats")
        firing.fired_once(firing.arm_on_every_shard(3, "w"))
    finally:
        firing.stop()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_coordinator_stuck_in_its_handlers_hands_its_shards_over_while_stuck(
    redis_client, prefix
):
    firing, hang = Firing(redis_client, prefix, 2), threading.Event()
    try:
        firing.join("a")
        firing.join("b", hang=hang)
        wait_for(firing.settled, 5, "a and b share the shards")
        hang.set()  # b's two handler threads hang on the first two timers they get
        armed = firing.arm_on_every_shard(6, "h")
        # once b has not moved for its lease, a claims b's shard too and fires what b left
        wait_for(lambda: firing.held()["a"] == (0, 1), 10, "a takes b's shard")
        assert Coordinators(redis_client, prefix).live() == ["a"]
        fired = lambda: {t for _, t in firing.fired} & set(armed)  # noqa: E731
        wait_for(lambda: len(fired()) == len(armed) - 2, 10, "all but b's two hung timers")
        hang.clear()  # b comes back: its two fire, and it rejoins the deal
        firing.fired_once(armed)
        wait_for(firing.settled, 5, "b rejoins the deal")
    finally:
        hang.clear()
        firing.stop()


def test_a_coordinator_that_cannot_read_the_registry_claims_every_shard(prefix):
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.2, socket_timeout=0.2)
    coordinator = TimerServices(RaceTimers(dead, RaceShards(prefix, count=3)), print, **BEAT)
    coordinator.start()
    try:  # duplicate claims cost claims; a shard nobody claims costs lag
        assert coordinator.shards == (0, 1, 2)
        assert coordinator.last_error is not None
        time.sleep(0.3)  # its beats fail too: it keeps what it holds
        assert coordinator.shards == (0, 1, 2)
    finally:
        coordinator.stop(timeout=1)


def on_shard_ids(count: int, shard: int, n: int, stem: str) -> list[str]:
    return [f"{stem}{i}" for i in range(2000) if shard_of(f"{stem}{i}", count) == shard][:n]


@pytest.mark.timeout(60)
def test_a_service_busy_with_quick_handlers_or_timers_held_ahead_is_not_stalled(
    redis_client, prefix
):
    timers = RaceTimers(redis_client, RaceShards(prefix, count=1))
    (store,) = timers.stores
    now = int(time.time() * 1000)
    for i in range(60):  # 60 x 30 ms in the service thread: 1.8 s of work, each quick
        store.arm(f"q{i}", now, {})
    lease = {"beat_ms": 100, "coordinator_lease_ms": 500}
    one = TimerServices(timers, lambda t: time.sleep(0.03), me="one", **lease).start()
    try:
        (service,) = one.services
        stalls = []
        while one.fired < 60:
            stalls.append(service.stalled(0.5))
            time.sleep(0.05)
        assert not any(stalls)
        assert Coordinators(redis_client, prefix).live() == ["one"]  # it never let go
    finally:
        one.stop()
    # two timers claimed 3 s ahead hold both slots of a two-thread service: idle, not stalled
    ahead = TimerServices(timers, print, me="ahead", threads=2, ahead_ms=3000, **lease).start()
    try:
        store.arm("e0", int(time.time() * 1000) + 2500, {})
        store.arm("e1", int(time.time() * 1000) + 2500, {})
        (service,) = ahead.services
        wait_for(lambda: len(service._early) == 2, 5, "both held ahead")
        time.sleep(1.0)
        assert not service.stalled(0.5)
    finally:
        ahead.stop()


def test_failing_redis_is_not_a_stall(prefix):
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.2, socket_timeout=0.2)
    coordinator = TimerServices(RaceTimers(dead, RaceShards(prefix)), print, threads=2, **BEAT)
    coordinator.start()
    try:  # its claims fail and back off for longer than a lease: nothing a handover would fix
        time.sleep(1.5)
        assert not any(s.stalled(0.4) for s in coordinator.services)
    finally:
        coordinator.stop(timeout=1)


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_shard_dealt_away_mid_handler_fires_it_once_and_keeps_the_counts(redis_client, prefix):
    timers = RaceTimers(redis_client, RaceShards(prefix, count=2))
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    def handler(timer: Timer) -> None:
        with lock:
            calls[timer.id] += 1
        if timer.payload.get("slow"):
            time.sleep(2.0)  # still running when its shard is dealt away and back

    a = TimerServices(timers, handler, me="a", threads=2, **BEAT).start()
    try:
        assert a.shards == (0, 1)
        (race,) = on_shard_ids(2, 1, 1, "r")
        store = timers.stores[1]
        slow = store.arm(f"{race}:slow", int(time.time() * 1000), {"slow": 1})
        wait_for(lambda: calls[slow] == 1, 5, "the slow handler started")
        b = TimerServices(timers, handler, me="b", threads=2, **BEAT).start()
        counts = []
        wait_for(lambda: counts.append(a.fired) or a.shards == (0,), 5, "a lets shard 1 go")
        b.stop()  # shard 1 comes back to a while its old service still waits for the handler
        wait_for(lambda: counts.append(a.fired) or a.shards == (0, 1), 5, "a takes it back")
        wait_for(lambda: counts.append(a.fired) or a.fired == 1, 10, "the slow timer counted")
        assert counts == sorted(counts)  # never went down while a service was being retired
        assert store.claims_carry_cancels  # the new service carries cancels, whatever the old did
        wait_for(lambda: store.in_flight() == 0, 5, "the slow timer acknowledged")
        assert calls[slow] == 1
    finally:
        a.stop()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_coordinator_that_stops_lets_go_before_waiting_for_its_handlers(redis_client, prefix):
    firing = Firing(redis_client, prefix, 2)
    slow = threading.Event()
    try:
        firing.join("a")
        firing.join("b", hang=slow, coordinator_lease_ms=5_000)  # a lapse would take 5 s
        wait_for(firing.settled, 5, "a and b share the shards")
        (b_shard,) = firing.held()["b"]
        slow.set()  # b's next handler runs until cleared
        (race,) = on_shard_ids(2, b_shard, 1, "g")
        firing.timers.stores[b_shard].arm(f"{race}:busy", int(time.time() * 1000), {})
        time.sleep(0.3)
        stopping = threading.Thread(target=firing.coordinators["b"].stop, args=(10,))
        stopping.start()
        # b has ended its lease at once: a takes its shard while b still waits for its handler
        wait_for(lambda: Coordinators(redis_client, prefix).live() == ["a"], 2, "b let go")
        wait_for(lambda: firing.coordinators["a"].shards == (0, 1), 2, "a took b's shard")
        assert stopping.is_alive()
        slow.clear()
        stopping.join(10)
    finally:
        slow.clear()
        firing.stop()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_the_others_fire_a_shard_s_timers_only_when_its_holder_falls_behind(redis_client, prefix):
    timers = RaceTimers(redis_client, RaceShards(prefix, count=2))
    fired: list[tuple[str, str, float]] = []  # (coordinator, timer id, lag ms)
    lock = threading.Lock()
    slow = threading.Event()

    def handler_of(me: str):
        def handler(timer: Timer) -> None:
            if me == "b" and slow.is_set():
                time.sleep(0.25)  # b keeps firing, four a second per thread: behind
            with lock:
                fired.append((me, timer.id, time.time() * 1000 - timer.due_ms))

        return handler

    a = TimerServices(timers, handler_of("a"), me="a", threads=2, **BEAT).start()
    b = TimerServices(timers, handler_of("b"), me="b", threads=2, **BEAT).start()
    try:
        wait_for(lambda: a.shards != b.shards and len(a.shards) == 1, 5, "one shard each")
        (b_shard,) = b.shards
        assert [h.store for h in a.helpers] == [timers.stores[b_shard]]
        store = timers.stores[b_shard]
        races = on_shard_ids(2, b_shard, 40, "k")
        keeping_up = [store.arm(f"{r}:x", int(time.time() * 1000), {}) for r in races[:20]]
        wait_for(lambda: {t for _, t, _ in fired} >= set(keeping_up), 10, "b's own fired")
        assert {me for me, t, _ in fired if t in keeping_up} == {"b"}  # nothing to help with
        slow.set()
        now = int(time.time() * 1000)
        behind = [store.arm(f"{r}:y", now, {}) for r in races[20:]]
        wait_for(lambda: {t for _, t, _ in fired} >= set(behind), 10, "b's late ones fired")
        ids = [t for _, t, _ in fired if t in behind]
        assert sorted(ids) == sorted(behind)  # each once
        helped = [lag for me, t, lag in fired if t in behind and me == "a"]
        assert helped, "a fired none of the timers b fell behind on"
        assert min(helped) >= HELP_BEHIND_MS  # only those already a helper's margin late
        assert b.shards == (b_shard,)  # b never stalled: it kept its shard
    finally:
        slow.clear()
        a.stop()
        b.stop()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_dead_holder_s_timers_are_fired_by_the_others_before_its_lease_lapses(
    redis_client, prefix
):
    firing = Firing(redis_client, prefix, 2)
    try:
        firing.join("a")
        firing.join("b", coordinator_lease_ms=30_000)  # its shard stays dealt to it 30 s
        wait_for(firing.settled, 5, "a and b share the shards")
        (b_shard,) = firing.held()["b"]
        crash(firing.coordinators["b"])
        armed_at = time.monotonic()
        (race,) = on_shard_ids(2, b_shard, 1, "d")
        timer = firing.timers.stores[b_shard].arm(f"{race}:t", int(time.time() * 1000), {})
        wait_for(lambda: timer in {t for _, t in firing.fired}, 5, "a's helper fired it")
        assert time.monotonic() - armed_at < 2  # a poll and a margin, not b's 30 s lease
        assert firing.coordinators["a"].shards == (1 - b_shard,)  # still dealt to b
    finally:
        firing.stop()


def test_a_helper_that_cannot_start_leaves_no_service_running(redis_client, prefix):
    timers = RaceTimers(redis_client, RaceShards(prefix, count=2))
    a = TimerServices(timers, print, me="a", name="orphan-a", threads=2, **BEAT)
    real, calls = a._helper, []

    def failing(shard):
        calls.append(shard)
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        return real(shard)

    a._helper = failing  # type: ignore[method-assign]
    a.start()
    b = TimerServices(timers, print, me="b", name="orphan-b", threads=2, **BEAT).start()
    try:  # a's shard given to b: a's service for it must stop although its helper failed once
        wait_for(lambda: len(a.shards) == 1 and len(a.helpers) == 1, 5, "a helps after a failure")
    finally:
        a.stop()
        b.stop()

    def running():
        return [t.name for t in threading.enumerate() if t.name.startswith("orphan-a")]

    wait_for(lambda: not running(), 5, "none of a's threads left")


def test_a_service_that_cannot_start_its_thread_undoes_what_did_start(redis_client, prefix):
    from gpuhedge_celery.store.timer_service import TimerService

    (store,) = RaceTimers(redis_client, RaceShards(prefix)).stores
    service = TimerService(store, print, threads=2, name="half-started")

    def no_thread():
        raise RuntimeError("can't start new thread")

    service._thread.start = no_thread  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="can't start new thread"):
        service.start()
    assert not store.claims_carry_cancels  # its cancels are sent at once again

    def left():
        return [t for t in threading.enumerate() if t.name.startswith("half-started")]

    wait_for(lambda: not left(), 5, "its worker threads gone")
