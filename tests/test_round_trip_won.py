"""Riders that act only if a save wins, on keys of another slot (the budget ledger's): in the
save's own pipeline on one Redis, in a round trip of their own after the save won on a Redis
Cluster (whose pipelines keep to one slot), on a real redis-server and (``[cluster]``) a real
cluster."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from gpuhedge_celery.store.round_trip import RoundTrip
from gpuhedge_celery.store.scripts import run_pipeline

pytestmark = [pytest.mark.redis, pytest.mark.cluster]


def _trip(seen: list[tuple[bool, str]], key: str) -> RoundTrip:
    trip = RoundTrip()

    def queue(pipe, known: bool) -> None:
        pipe.incr(key)

    trip.ride_won(queue, (), lambda replies: seen.append((True, str(replies[0]))))
    # a rider that records how it was queued (in the save's pipeline or after it)
    trip.ride_won(lambda pipe, known: (seen.append((known, "queued")), pipe.get(key))[1])
    return trip


def _save(client, trip: RoundTrip, state_key: str) -> list:
    def build(pipe) -> None:
        trip.queue_ahead(pipe)
        pipe.set(state_key, "v1")
        trip.queue_after(pipe)

    replies = run_pipeline(client, build, trip.scripts)
    trip.answer(replies)
    trip.send_won(client)
    return replies


def test_they_ride_in_the_saves_pipeline_on_one_redis_and_follow_it_on_a_cluster(
    redis_client, prefix, on_cluster
):
    seen: list[tuple[bool, str]] = []
    ledger, state = f"{prefix}:{{budget}}:count", f"{prefix}:race:{{r1}}:state"
    replies = _save(redis_client, _trip(seen, ledger), state)
    if on_cluster:  # a cluster pipeline keeps to the race's slot: the riders follow the save
        assert key_slot(ledger.encode()) != key_slot(state.encode())
        assert len(replies) == 1 and seen == [(True, "queued"), (True, "1")]
    else:  # the save and both riders: one round trip
        assert len(replies) == 3 and seen == [(False, "queued"), (True, "1")]
    assert redis_client.get(ledger) == "1" and redis_client.get(state) == "v1"


def test_a_round_trip_handed_to_a_step_refuses_won_riders():
    trip = RoundTrip()
    trip.ride_won(lambda pipe, known: None)
    with pytest.raises(ValueError, match="ahead of it only"):
        trip.ahead_only()
