"""Race timers on several race shards (``GPUHEDGE_RACE_SHARDS``) on a real redis-server: a
race's timers in its shard's namespace only, every shard's timers fired once by two processes'
services, races on different shards driven to their end through their own shard's timers."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpuhedge_celery.race.base import RaceParts
from gpuhedge_celery.race.driver import RaceDriver
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.race.watch_batch import WatchBatch
from gpuhedge_celery.store.race_keys import RaceShards, shard_of
from gpuhedge_celery.store.races import RaceStore
from gpuhedge_celery.store.timer_service import TimerServices
from gpuhedge_celery.store.timers import RaceTimers, Timer, TimerStore
from tests.support.waiting import wait_for
from tests.test_races_driver import SLOW, Recorder, build_driver
from tests.test_watch_batch import RoundTrips, handled, started_and_due, watch_timers

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]

SHARDS = 3


def on_shard(k: int, n: int, stem: str = "s") -> list[str]:
    """``n`` race ids whose shard is ``k`` of ``SHARDS``."""
    found = [f"{stem}{i}" for i in range(1000) if shard_of(f"{stem}{i}", SHARDS) == k]
    return found[:n]


def waiting_ids(store: TimerStore) -> list[str]:
    return store.client.zrange(store.keys.due, 0, -1) + store.client.zrange(
        store.keys.inflight, 0, -1
    )


def test_one_shard_keeps_the_single_timer_namespace_of_old(redis_client, prefix):
    (store,) = RaceTimers(redis_client, RaceShards(prefix, "races", 1)).stores
    assert store.keys == TimerStore(redis_client, prefix, "races").keys


def test_a_race_s_timers_are_armed_in_its_shard_s_namespace_only(redis_client, prefix):
    driver, _, cfg, _, _ = build_driver(redis_client, prefix, Recorder(), shards=SHARDS)
    tags = driver.timers.shards.tags
    assert len(set(tags)) == SHARDS
    races = [on_shard(k, 2)[i] for k in range(SHARDS) for i in range(2)]
    for race_id in races:
        driver.create(race_id, SLOW, build_spec(cfg))
        driver.submit_attempt(race_id, "a1")
    for k, store in enumerate(driver.timers.stores):
        assert f"{{{tags[k]}}}" in store.keys.due  # the shard's own hash tag
        owners = {timer_id.split("|")[0].split(":")[0] for timer_id in waiting_ids(store)}
        assert owners == set(on_shard(k, 2))  # its races' timers, and no other race's
    # each race: its deadline, its hedge and its job's next poll
    assert driver.timers.pending() == 3 * len(races)


@pytest.mark.parametrize("threads", [1, 4])
def test_timers_of_every_shard_fire_once_with_two_processes(redis_client, prefix, threads):
    timers = RaceTimers(redis_client, RaceShards(prefix, count=SHARDS))
    fired: list[Timer] = []
    lock = threading.Lock()

    def handler(timer: Timer) -> None:
        with lock:
            fired.append(timer)

    processes = [
        TimerServices(timers, handler, threads=threads, ahead_ms=20).start() for _ in range(2)
    ]
    try:
        due = int(time.time() * 1000) + 100
        armed = []
        for k in range(SHARDS):
            for i, race_id in enumerate(on_shard(k, 20)):
                store = timers.of(race_id)
                armed.append(store.arm(f"{race_id}:t", due + 2 * i, {"race": race_id}))
        wait_for(lambda: len(fired) >= len(armed), 15, "every shard's timers fired")
        time.sleep(0.3)  # a second firing would show by now
        wait_for(lambda: timers.pending() + timers.in_flight() == 0, 10, "all acknowledged")
    finally:
        for services in processes:
            services.stop()
    assert sorted(t.id for t in fired) == sorted(armed)
    assert sum(services.fired for services in processes) == len(armed)


def test_timer_services_share_the_process_s_timer_threads(redis_client, prefix):
    def shares(count, **options):
        coordinator = TimerServices(
            RaceTimers(redis_client, RaceShards(prefix, f"t{count}", count)), print, **options
        ).start()
        try:  # alone, it holds every shard
            return [(s.threads, s.ahead_ms, s._name) for s in coordinator.services]
        finally:
            coordinator.stop()

    twelve = shares(12, threads=16, ahead_ms=25)
    assert [threads for threads, _, _ in twelve] == [2] * 12  # a pool each, 24 in all, not 192
    assert len({name for _, _, name in twelve}) == 12
    assert [threads for threads, _, _ in shares(3, threads=16)] == [6] * 3
    assert [(t, ahead) for t, ahead, _ in shares(3, threads=1, ahead_ms=25)] == [(1, 0)] * 3


class Launching(Recorder):
    """Effects that submit launches and cancel losers on their own threads, as a worker's."""

    def __init__(self) -> None:
        super().__init__()
        self.driver = None
        self.pool = ThreadPoolExecutor(4)

    def launch(self, race_id, attempt_id, provider):
        super().launch(race_id, attempt_id, provider)
        self.pool.submit(self.driver.submit_attempt, race_id, attempt_id)

    def cancel(self, race_id, attempt_id, provider):
        super().cancel(race_id, attempt_id, provider)
        self.pool.submit(self.driver.cancel_attempt, race_id, attempt_id)


def test_races_on_two_shards_are_hedged_and_won_through_their_own_shard_s_timers(
    redis_client, prefix, monkeypatch
):
    effects = Launching()
    driver, _, cfg, _, _ = build_driver(redis_client, prefix, effects, shards=SHARDS)
    effects.driver = driver
    tags = driver.timers.shards.tags
    claimed: dict[str, set[str]] = {tag: set() for tag in tags}
    for tag, store in zip(tags, driver.timers.stores, strict=True):

        def spy(*args, _claim=store.claim, _tag=tag, **kwargs):
            found = _claim(*args, **kwargs)
            claimed[_tag].update(t.payload["race"] for t in found.timers)
            return found

        monkeypatch.setattr(store, "claim", spy)
    first, last = on_shard(0, 1)[0], on_shard(SHARDS - 1, 1)[0]
    # the primary runs a long while: the hedge, launched by its timer, wins (hedge at 100 ms)
    request = {"sim": {"p": {"queue_s": 5, "run_s": 100}, "h": {"queue_s": 0, "run_s": 1}}}
    services = TimerServices(
        driver.timers, driver.on_timer, threads=4, batch_handler=WatchBatch(driver).handle
    ).start()
    try:
        for race_id in (first, last):
            driver.create(race_id, request, build_spec(cfg, policy="hedge:p->h@0.1s"))
        wait_for(lambda: len(effects.results) == 2, 20, "both races won")
        wait_for(
            lambda: all(driver.store.receipt(r) is not None for r in (first, last)), 10, "receipts"
        )
    finally:
        services.stop()
        effects.pool.shutdown(wait=True)
    for race_id in (first, last):
        receipt = driver.store.receipt(race_id)
        assert receipt["winner"] == "a2" and receipt["hedged"]  # the hedge its timer launched
        assert (race_id, "a1") in effects.cancelled  # the loser, cancelled
    assert {r["attempt"] for r in effects.results} == {"a2"}
    assert claimed == {tags[0]: {first}, tags[1]: set(), tags[SHARDS - 1]: {last}}


def test_a_batch_of_polls_on_several_shards_is_saved_in_one_round_trip_per_shard(
    redis_client, prefix, monkeypatch, on_cluster
):
    driver, effects, cfg, _, _ = build_driver(redis_client, prefix, Recorder(), shards=SHARDS)
    races = [race_id for k in range(SHARDS) for race_id in on_shard(k, 4, "b")]
    versions, timers = started_and_due(driver, cfg, races)
    trips = RoundTrips(monkeypatch)
    assert handled(WatchBatch(driver), timers) == []
    # the sim's ledger read, then a pipeline per shard
    assert trips.count == trips.ledger_reads(on_cluster) + SHARDS
    for race_id in races:
        assert driver.store.load(race_id).version == versions[race_id] + 1
        assert len(watch_timers(driver, race_id)) == 1  # its next poll, on its shard
    assert effects.events.count("running") == len(races)


def test_a_driver_whose_timers_are_sharded_unlike_its_races_is_refused(redis_client, prefix):
    store = RaceStore(redis_client, RaceShards(prefix, count=SHARDS))
    timers = RaceTimers(redis_client, RaceShards(prefix))  # one shard: its timers elsewhere
    with pytest.raises(ValueError, match="race store shards .* differ from the timers'"):
        RaceDriver(RaceParts(store, timers, {}.__getitem__, Recorder()))
