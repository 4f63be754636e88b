"""Riders that act only if a save wins, on keys of another slot (the budget ledger's): in the
save's own pipeline on one Redis, in a round trip of their own after the save won on a Redis
Cluster (whose pipelines keep to one slot), on a real redis-server and a real cluster."""

from __future__ import annotations

import uuid

import pytest

from gpuhedge_celery.store.connection import redis_from_url
from gpuhedge_celery.store.round_trip import RoundTrip
from gpuhedge_celery.store.scripts import run_pipeline

pytestmark = pytest.mark.redis


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


def test_on_one_redis_they_ride_in_the_saves_pipeline(redis_client, prefix):
    seen: list[tuple[bool, str]] = []
    ledger = f"{prefix}:{{budget}}:count"
    replies = _save(redis_client, _trip(seen, ledger), f"{prefix}:race:{{r1}}:state")
    assert len(replies) == 3  # the save and both riders: one round trip
    assert seen == [(False, "queued"), (True, "1")]
    assert redis_client.get(ledger) == "1"


def test_on_a_cluster_they_follow_a_won_save_in_a_round_trip_of_their_own(redis_cluster):
    client = redis_from_url(redis_cluster.url, decode_responses=True)
    base = f"t{uuid.uuid4().hex[:10]}"
    ledger, state = f"{base}:{{budget}}:count", f"{base}:race:{{r1}}:state"
    assert redis_cluster.key_slot(ledger) != redis_cluster.key_slot(state)
    seen: list[tuple[bool, str]] = []
    try:
        replies = _save(client, _trip(seen, ledger), state)
        assert len(replies) == 1  # the save alone: its pipeline keeps to the race's slot
        assert seen == [(True, "queued"), (True, "1")]
        assert client.get(ledger) == "1" and client.get(state) == "v1"
    finally:
        client.delete(ledger, state)


def test_a_round_trip_handed_to_a_step_refuses_won_riders():
    trip = RoundTrip()
    trip.ride_won(lambda pipe, known: None)
    with pytest.raises(ValueError, match="ahead of it only"):
        trip.ahead_only()
