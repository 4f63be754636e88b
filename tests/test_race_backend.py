"""The app's result backend marks a race's first winner without reading the stored state first.

A real Celery app and result backend on the real Redis, on a Sentinel group (``[sentinel]``,
the package's Sentinel backend), and on the plain Redis beside a Redis Cluster store
(``[cluster]``); the read is counted on the backend.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.redis_url import is_sentinel
from gpuhedge_celery.store.round_trip import RoundTrip
from gpuhedge_celery.tasks.app import create_app
from gpuhedge_celery.tasks.config import GlueConfig
from gpuhedge_celery.tasks.race_backend import RaceRedisBackend, RaceSentinelBackend
from tests.support.fixtures_celery import CLUSTER

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60), pytest.mark.sentinel, pytest.mark.cluster]


# why the claim writes no caller's result on a cluster store
@pytest.fixture
def backend(redis_url, prefix, monkeypatch, broker, request):
    env = {"GPUHEDGE_REDIS_URL": redis_url, "GPUHEDGE_PREFIX": prefix}
    if broker == CLUSTER:  # Celery's broker and results on the plain Redis beside the cluster
        env["GPUHEDGE_BROKER_URL"] = request.getfixturevalue("plain_redis_url")
    app = create_app(GlueConfig.from_env(env))
    found = app.backend
    assert isinstance(found, RaceRedisBackend)
    assert isinstance(found, RaceSentinelBackend) == is_sentinel(redis_url)
    reads = []
    original = found.get
    monkeypatch.setattr(found, "get", lambda key: reads.append(key) or original(key))
    found.reads = reads
    return found


def test_a_first_win_is_stored_in_one_write_and_reads_back_as_mark_as_done_would(backend):
    result = {"winner": "p", "attempt": "a1", "payload": {"text": "hi"}}
    backend.mark_won("race-1", result)
    assert backend.reads == []  # no read before the write
    backend.mark_as_done("race-2", result)
    assert len(backend.reads) == 1  # Celery's own path reads the stored state first
    won, done = backend.get_task_meta("race-1"), backend.get_task_meta("race-2")
    assert won["status"] == done["status"] == "SUCCESS"
    assert won["result"] == done["result"] == result
    assert sorted(won) == sorted(done) and won["task_id"] == "race-1"


def test_other_writes_still_read_first(backend):
    backend.mark_won("race-3", {"winner": "p", "attempt": "a1"})
    backend.reads.clear()
    backend.mark_as_done("race-3", {"winner": "h"})  # a stored SUCCESS is never overwritten
    assert len(backend.reads) == 1
    assert backend.get_task_meta("race-3")["result"] == {"winner": "p", "attempt": "a1"}


@pytest.mark.one_redis  # Celery's results are never on a Redis Cluster store: no claim writes
def test_a_win_written_by_the_winner_claim_reads_back_as_mark_won_writes_it(
    backend, redis_client, prefix
):
    from gpuhedge_celery.store.races import RaceStore, WinnerClaim

    store = RaceStore(redis_client, prefix)
    result = {"winner": "p", "attempt": "a1", "payload": {"text": "hi"}}
    write = backend.won_write("race-4", result, redis_client)
    assert write is not None and write.expires_ms > 0
    listener = redis_client.pubsub()
    listener.subscribe(write.key)
    assert listener.get_message(timeout=2)["type"] == "subscribe"

    store.create("race-4", {"n": 0})
    took = []

    def save(version, save_id):
        mark = store.save_mark("race-4", version, save_id)
        trip = RoundTrip()
        trip.ride(
            lambda pipe: store.queue_claim_winner(pipe, "race-4", "a1", mark, write),
            [store.claim_winner_script],
            took.append,
        )
        return store.save("race-4", {"n": version}, version, trip, save_id)

    assert save(1, "s1") == 2
    assert RaceStore.winner_claim(took[-1][0]).first
    published = listener.get_message(timeout=2)
    assert published["type"] == "message" and published["channel"] == write.key
    backend.mark_won("race-5", result)
    written, marked = backend.get_task_meta("race-4"), backend.get_task_meta("race-5")
    assert written["status"] == marked["status"] == "SUCCESS"
    assert written["result"] == marked["result"] == result
    assert sorted(written) == sorted(marked) and written["task_id"] == "race-4"
    assert 0 < redis_client.pttl(write.key) <= write.expires_ms
    # the same save sent again after its answer was lost: still the claim that made the
    # winner (so the caller's result is known written), and nothing is written again
    redis_client.set(write.key, "sentinel")
    assert save(1, "s1") == 2
    assert RaceStore.winner_claim(took[-1][0]).first
    assert redis_client.get(write.key) == "sentinel"
    assert listener.get_message(timeout=0.2) is None
    listener.close()
    # a standalone claim that made the winner first (a resume between the save and its claim)
    # leaves the riding claim not first: it writes nothing, the effects decide after the save
    store.create("race-8", {"n": 0})
    store.claim_winner("race-8", "a1")
    took.clear()
    mark = store.save_mark("race-8", 1, "t1")
    write8 = backend.won_write("race-8", result, redis_client)
    trip = RoundTrip()
    trip.ride(
        lambda pipe: store.queue_claim_winner(pipe, "race-8", "a1", mark, write8),
        [store.claim_winner_script],
        took.append,
    )
    store.save("race-8", {"n": 1}, 1, trip, "t1")
    assert RaceStore.winner_claim(took[-1][0]) == WinnerClaim(won=True, winner="a1", first=False)
    assert redis_client.get(write8.key) is None
    # a store on another Redis database: the backend writes the result itself, after the save
    other = on_another_database(redis_client)
    assert backend.won_write("race-6", result, other) is None
    other.close()


def on_another_database(client):
    """A client of the same Redis as ``client`` (a server, or a Sentinel group's primary) on the
    next database."""
    import redis.sentinel

    pool = client.connection_pool
    db = int(pool.connection_kwargs.get("db") or 0) + 1
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):
        return pool.sentinel_manager.master_for(pool.service_name, db=db)
    where = pool.connection_kwargs
    return redis.Redis(host=where["host"], port=where["port"], db=db)


@pytest.mark.one_redis  # Celery's results are never on a Redis Cluster store: no claim writes
def test_a_claim_in_a_save_that_loses_writes_no_result(backend, redis_client, prefix):
    from gpuhedge_celery.store.races import RaceStore, VersionConflict

    store = RaceStore(redis_client, prefix)
    write = backend.won_write("race-7", {"winner": "p", "attempt": "a1"}, redis_client)
    store.create("race-7", {"n": 0})
    store.save("race-7", {"n": 1}, 1)
    mark = store.save_mark("race-7", 1, "late")
    trip = RoundTrip()
    trip.ride(
        lambda pipe: store.queue_claim_winner(pipe, "race-7", "a1", mark, write),
        [store.claim_winner_script],
    )
    with pytest.raises(VersionConflict):  # computed from version 1: it loses
        store.save("race-7", {"n": 2}, 1, trip, "late")
    assert redis_client.get(write.key) is None and store.winner("race-7") is None


def test_a_pool_that_does_not_say_where_it_connects_is_never_the_same_database(backend):
    import redis

    from gpuhedge_celery.store.connection import same_database

    unknown = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=redis.Connection))
    unknown.connection_pool.connection_kwargs.pop("host", None)
    assert not same_database(unknown, unknown)
    assert same_database(backend.client, backend.client)


def test_a_store_on_a_redis_cluster_never_takes_the_caller_result_into_its_claim(backend):
    """Celery's results live on a Redis of their own beside a cluster store: the claim keeps
    to the race's slot and the backend writes the result after the save."""
    from gpuhedge_celery.redis_url import parse_cluster_url
    from gpuhedge_celery.store.cluster import ClusterClient

    store_client = ClusterClient(None, parse_cluster_url("redis+cluster://127.0.0.1:7000"))
    result = {"winner": "p", "attempt": "a1"}
    assert backend.won_write("race-9", result, store_client) is None
