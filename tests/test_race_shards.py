"""Races spread over several shards on one plain Redis: each race's keys and its shard's indexes
share one Cluster slot (every pipeline a race's save or finish sends keeps to it), and every
reader of the indexes (lookups, the janitor's scan, watch, records, gauges) finds races on
every shard."""

from __future__ import annotations

import time

import pytest
from redis.crc import key_slot

from gpuhedge_celery.commands.watch import snapshot
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.metrics.redis_gauges import RedisGauges
from gpuhedge_celery.store.race_keys import RaceShards, check_name, shard_indexes
from gpuhedge_celery.store.race_lookup import races_starting_with, recently_finished
from gpuhedge_celery.store.race_receipts import Finish
from gpuhedge_celery.store.races import RaceStore
from gpuhedge_celery.store.round_trip import RoundTrip

pytestmark = pytest.mark.cluster

SHARDS = 3
_SCRIPTS = {"EVALSHA", "EVAL"}


def _keys_of(command: tuple) -> list[str]:
    """The keys one queued command names (a script's from its numkeys, else its first
    argument); none for a keyless one."""
    name = str(command[0]).upper()
    if name in _SCRIPTS:
        return [str(k) for k in command[3 : 3 + int(command[2])]]
    return [str(command[1])] if len(command) > 1 and name not in {"PUBLISH", "WAIT"} else []


class SlotRecorder:
    """A redis-py client that notes the keys of every pipeline it runs."""

    def __init__(self, client):
        self._client = client
        self.pipelines: list[list[str]] = []

    def pipeline(self, *args, **kwargs):
        pipe = self._client.pipeline(*args, **kwargs)
        execute = pipe.execute

        def noted(*a, **k):
            self.pipelines.append([key for c in pipe.command_stack for key in _keys_of(c[0])])
            return execute(*a, **k)

        pipe.execute = noted
        return pipe

    def __getattr__(self, name):
        return getattr(self._client, name)


def _slots(keys: list[str]) -> set[int]:
    return {key_slot(key.encode()) for key in keys}


@pytest.fixture
def sharded(redis_client, prefix):
    recorder = SlotRecorder(redis_client)
    return RaceStore(recorder, RaceShards(prefix, count=SHARDS)), recorder


def _ids_on_every_shard(shards: RaceShards, per_shard: int = 2) -> list[str]:
    """Race ids, ``per_shard`` on each shard."""
    found: dict[str, list[str]] = {tag: [] for tag in shards.tags}
    n = 0
    while any(len(ids) < per_shard for ids in found.values()):
        race_id = f"race-{n}"
        if len(found[shards.tag_of(race_id)]) < per_shard:
            found[shards.tag_of(race_id)].append(race_id)
        n += 1
    return [race_id for ids in found.values() for race_id in ids]


def test_the_shards_are_on_distinct_slots_and_a_race_keeps_its_shard(redis_client, prefix):
    shards = RaceShards(prefix, count=SHARDS)
    assert len(_slots([f"{{{tag}}}" for tag in shards.tags])) == SHARDS
    ids = _ids_on_every_shard(shards)
    assert {shards.tag_of(r) for r in ids} == set(shards.tags)
    for race_id in ids:
        index = shards.index_of(race_id)
        keys = [*shards.race(race_id).all(), index.live, index.finished, index.records]
        assert _slots(keys) == _slots([f"{{{shards.tag_of(race_id)}}}"])
    assert RaceShards(prefix).tags == ("races",)  # one shard: the namespace itself
    with pytest.raises(ValueError, match="race shards must be a whole number"):
        RaceShards(prefix, count=0)
    assert RaceStore(redis_client, RaceShards(prefix + "x")).prefix == prefix + "x"


def test_every_pipeline_of_a_race_keeps_to_its_shards_slot(sharded):
    races, recorder = sharded
    for race_id in _ids_on_every_shard(races.shards, 1):
        races.create(race_id, {"n": 0}, request={"text": "hi"})
        races.add_job(race_id, "a1", {"provider": "p", "job_id": "j1"})
        trip = RoundTrip()
        mark = races.save_mark(race_id, 1, "s1")
        trip.ride(
            lambda pipe, r=race_id, m=mark: races.queue_claim_winner(pipe, r, "a1", m),
            [races.claim_winner_script],
        )
        done = Finish({"winner": "a1"}, 60, ("a1",), {"kind": "race", "race_id": race_id})
        races.ride_finish(trip, race_id, done, mark)
        assert races.save(race_id, {"n": 1}, 1, trip, "s1") == 2
        races.finish(race_id, {"winner": "a1", "again": True}, 60)
        races.put_receipt(race_id, {"winner": "a1"}, 60, record={"race_id": race_id})
    assert recorder.pipelines
    for keys in recorder.pipelines:
        assert len(_slots(keys)) == 1, keys


def test_readers_find_races_on_every_shard(sharded, redis_client, prefix):
    races, _ = sharded
    ids = _ids_on_every_shard(races.shards)
    running, done = ids[::2], ids[1::2]
    for race_id in ids:
        races.create(race_id, {"race": {"attempts": [], "policy": {}, "timers": {}}})
    for race_id in done:
        record = {"kind": "race", "race_id": race_id}
        races.finish(race_id, {"race_id": race_id}, 60, record=record)
        time.sleep(0.002)  # each record a later stream id
    assert {index.tag for index in races.shards.indexes} == set(races.shards.tags)
    assert sorted(r for r, _ in recently_finished(races)) == sorted(done)
    assert races_starting_with(races, "race-") == sorted(ids)[:10]
    assert [r["race_id"] for _, r in races.records.read()] == done  # merged in time order
    assert races.records.length() == len(done)
    rows = snapshot(races, include_finished=True)["races"]
    assert {row["race_id"] for row in rows} >= set(ids)
    reading = RedisGauges(redis_client, prefix, shards=races.shards).read()
    assert reading.get("gpuhedge_races_in_flight") == len(running)
    # the SCAN fallback (no index knows the id) reads the keys of every shard
    for race_id in ids:
        index = races.shards.index_of(race_id)
        redis_client.zrem(index.live, race_id)
        redis_client.zrem(index.finished, race_id)
    assert races_starting_with(races, "race-", limit=100) == sorted(ids)
    assert shard_indexes(prefix, races.shards.tags[1]) == races.shards.indexes[1]


def test_the_janitors_scan_reads_every_shards_live_index(redis_client, prefix):
    shards = RaceShards(prefix, count=SHARDS)
    now = time.time()
    old = RaceStore(redis_client, shards, clock=VirtualClock(now - 120))
    fresh = RaceStore(redis_client, shards)
    ids = _ids_on_every_shard(shards)
    for i, race_id in enumerate(ids):
        store = fresh if race_id == ids[-1] else old
        store.add_job(race_id, "a1", {"provider": "p", "job_id": f"j{i}"})
    fresh.claim_owner(ids[0], "slow-coordinator", lease_ms=30_000)
    stale = {s.race_id: s for s in fresh.stale_races(stale_ms=60_000)}
    assert set(stale) == set(ids[1:-1])  # every shard's; not the owned nor the fresh one
    assert {shards.tag_of(r) for r in stale} == set(shards.tags)
    assert stale[ids[1]].live_jobs == {"a1": {"provider": "p", "job_id": "j1"}}
    limited = fresh.stale_races(stale_ms=60_000, limit=2)
    assert len(limited) <= 2 and {s.race_id for s in limited} <= set(stale)


def test_readers_outside_the_workers_take_the_deployments_shards_from_its_environment(
    redis_client,
):
    from gpuhedge_celery.settings import ProcessSettings

    env = {"GPUHEDGE_RACE_SHARDS": "3", "GPUHEDGE_TIMER_NAMESPACE": "ns"}
    shards = ProcessSettings.from_env(env).race_shards("p")
    assert (shards.prefix, shards.tags) == ("p", RaceShards("p", "ns", 3).tags)
    plain = ProcessSettings.from_env({})
    assert plain.race_shards("p").tags == ("races",)
    # the Redis a caller was given decides the default count, as the workers' URL does theirs
    assert plain.race_shards("p", "redis+cluster://127.0.0.1:7000").count == 3
    gauges = RedisGauges(redis_client, "p", shards=shards)
    assert gauges.namespaces == shards.tags  # every shard's timers


class _Stepper:
    """The part of a driver ``stop_revoked`` uses: its store, and the steps it is handed."""

    def __init__(self, store):
        self.store = store
        self.steps: list[str] = []

    def step(self, race_id, event):
        self.steps.append(race_id)


def test_batched_loads_and_revokes_find_races_on_every_shard_a_pipeline_a_slot(sharded):
    from gpuhedge_celery.tasks.revokes import stop_revoked

    races, recorder = sharded
    ids = _ids_on_every_shard(races.shards, 1)
    for race_id in ids:
        races.create(race_id, {"n": race_id})
    recorder.pipelines.clear()
    wanted = [*reversed(ids), "nope"]
    found = races.load_many(wanted)
    assert [r.state if r else None for r in found] == [{"n": r} for r in reversed(ids)] + [None]
    driver = _Stepper(races)
    assert stop_revoked(driver, ["nope", ids[2], "bad{id", ids[0], ids[1]]) == [
        ids[2], ids[0], ids[1],
    ]  # fmt: skip
    assert driver.steps == [ids[2], ids[0], ids[1]]
    assert len(recorder.pipelines) == 2 * SHARDS  # one per shard for each
    for keys in recorder.pipelines:
        assert len(_slots(keys)) == 1, keys


def test_the_record_streams_together_keep_about_the_cap(redis_client, prefix):
    from gpuhedge_celery.store.records import RecordStream

    shards = RaceShards(prefix, count=SHARDS)
    stream = RecordStream(redis_client, prefix, maxlen=300, shards=shards)
    assert stream.shard_maxlen == 100  # each shard's share
    pipes = {tag: redis_client.pipeline(transaction=False) for tag in shards.tags}
    for i in range(3000):
        race_id = f"r{i}"
        stream.queue_append(pipes[shards.tag_of(race_id)], race_id, {"race_id": race_id})
    for pipe in pipes.values():
        pipe.execute()
    # MAXLEN ~ trims whole nodes (100 entries each): each shard keeps its 100, a little more
    assert all(100 <= redis_client.xlen(key) <= 300 for key in stream.keys)
    assert 300 <= stream.length() <= 900
    assert RecordStream(redis_client, prefix, maxlen=7, shards=shards).shard_maxlen == 3


@pytest.mark.parametrize("bad", ["r1\n", "r 1", "r{1}", ""])
def test_a_race_id_must_end_where_its_characters_do(bad):
    # "$" would let a final newline through into a key name and a hash tag
    with pytest.raises(ValueError, match="invalid race id"):
        check_name(bad, "race id")
