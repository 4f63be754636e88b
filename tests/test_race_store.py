"""The race store on a real redis-server: versioned saves, one winner, janitor index, receipts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import redis

from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.errors import LeaseError, StoreError
from gpuhedge_celery.store.connection import redis_from_url
from gpuhedge_celery.store.race_copies import Copy
from gpuhedge_celery.store.race_keys import RaceShards
from gpuhedge_celery.store.race_liveness import OwnershipLost
from gpuhedge_celery.store.race_receipts import Finish
from gpuhedge_celery.store.races import Keeping, RaceStore, VersionConflict, WinnerClaim
from gpuhedge_celery.store.round_trip import RoundTrip
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(90), pytest.mark.cluster]

# spawn, not fork: earlier tests leave listener threads whose held locks a fork would copy
ctx = multiprocessing.get_context("spawn")


@pytest.fixture
def races(redis_client, prefix):
    return RaceStore(redis_client, prefix)


# -- versioned state -----------------------------------------------------------------------------


def test_create_load_save_and_conflicts(races):
    assert races.load("r1") is None
    assert races.create("r1", {"phase": "primary"}) == 1
    with pytest.raises(VersionConflict, match="already exists") as info:
        races.create("r1", {"phase": "other"})
    assert (info.value.expected, info.value.current) == (0, 1)

    record = races.load("r1")
    assert (record.version, record.state) == (1, {"phase": "primary"})
    assert races.save("r1", {"phase": "hedged"}, record.version) == 2
    # A second coordinator that read version 1 must not advance the race again.
    with pytest.raises(VersionConflict, match="at version 2, not 1") as info:
        races.save("r1", {"phase": "cut over"}, record.version)
    assert races.load("r1").state == {"phase": "hedged"}
    with pytest.raises(VersionConflict, match="does not exist") as gone:
        races.save("nope", {}, 3)
    # A conflict is answered with the state there, so the loser can decide again from it
    # without reading it: the race as saved, or no race at all.
    found = info.value.found
    assert info.value.read and (found.version, found.state) == (2, {"phase": "hedged"})
    assert not found.cached
    assert gone.value.read and gone.value.found is None
    assert isinstance(VersionConflict("r", 1, 2), StoreError)


def test_a_conflict_whose_state_does_not_decode_leaves_the_read_to_the_caller(
    races, redis_client, prefix, caplog
):
    # A hash missing one of its parts (a race says 2 attempts, only one is there): the
    # refusal still raises VersionConflict, without a state, so the caller reads the race
    # itself (and meets the error there) instead of a decode error escaping a batch of saves.
    from gpuhedge_celery.store import race_parts

    races.create("rb", {"race": {"attempts": [{"id": "a1"}, {"id": "a2"}]}})
    record = races.load("rb")
    races.save("rb", {"race": {"attempts": [{"id": "a1"}, {"id": "a2"}], "n": 1}}, 1)
    redis_client.hdel(RaceShards(prefix).race("rb").state, f"{race_parts.ATTEMPT}1")
    with pytest.raises(VersionConflict) as info:
        races.save("rb", {"race": {"attempts": []}}, record.version)
    assert (info.value.expected, info.value.current) == (1, 2)
    assert not info.value.read and info.value.found is None
    assert "does not decode" in caplog.text


def test_a_winner_claim_riding_in_a_save_claims_only_if_the_save_wins(races):
    races.create("r1", {"n": 0})
    took = []

    def save(version, attempt, save_id):
        mark = races.save_mark("r1", version, save_id)
        trip = RoundTrip()
        trip.ride(
            lambda pipe: races.queue_claim_winner(pipe, "r1", attempt, mark),
            [races.claim_winner_script],
            took.append,
        )
        return races.save("r1", {"n": version}, version, trip, save_id)

    assert save(1, "a1", "s1") == 2
    assert races.winner_claim(took[-1][0]) == WinnerClaim(won=True, winner="a1", first=True)
    with pytest.raises(VersionConflict):  # a step computed from version 1 again: it loses
        save(1, "a2", "s2")
    assert races.winner("r1") == "a1" and len(took) == 1  # nothing claimed, nothing taken
    # the same save sent again after its answer was lost: saved, and still the claim that
    # made the winner (its first send's answer never arrived)
    assert save(1, "a1", "s1") == 2
    assert races.winner_claim(took[-1][0]) == WinnerClaim(won=True, winner="a1", first=True)
    # a claim of its own (a resume re-declaring) finds the same winner, not first
    assert races.claim_winner("r1", "a1") == WinnerClaim(won=True, winner="a1", first=False)


def test_a_finish_riding_in_a_save_finishes_only_if_the_save_wins_and_once(
    races, redis_client, prefix
):
    keys = RaceShards(prefix).race("r1")
    races.create("r1", {"n": 0})
    redis_client.set(keys.request, "{}")
    races.add_job("r1", "a1", {"provider": "p", "job_id": "j1"})
    races.add_job("r1", "a2", {"provider": "h", "job_id": "j2"})
    assert races.last_seen_ms("r1") is not None  # in the live index

    def save(version, save_id, drop):
        mark = races.save_mark("r1", version, save_id)
        trip = RoundTrip()
        done = Finish({"winner": "a2", "n": version}, 60, tuple(drop), {"race": "r1"})
        races.ride_finish(trip, "r1", done, mark)
        return races.save("r1", {"n": version}, version, trip, save_id)

    assert races.save("r1", {"n": 1}, 1) == 2
    with pytest.raises(VersionConflict):  # computed from version 1: loses, finishes nothing
        save(1, "s1", ["a1", "a2"])
    assert races.receipt("r1") is None and races.records.length() == 0
    assert redis_client.exists(keys.request) and races.live_jobs("r1")
    # a finish that leaves a job registered keeps the race for the janitor
    assert save(2, "s2", ["a2"]) == 3
    assert races.receipt("r1") == {"winner": "a2", "n": 2}
    assert list(races.live_jobs("r1")) == ["a1"] and races.last_seen_ms("r1") is not None
    assert not redis_client.exists(keys.request)
    assert 0 < redis_client.pttl(keys.state) <= 60_000
    # the same save sent again after its answer was lost: saved, finished once
    assert save(2, "s2", ["a2"]) == 3
    assert races.records.length() == 1
    assert races.last_seen_ms("r1") is not None
    # the job's own cancel confirmed it later: a finish with no job left leaves the live index
    races.create("r2", {"n": 0})
    races.add_job("r2", "a1", {"provider": "p", "job_id": "j3"})
    trip = RoundTrip()
    races.ride_finish(trip, "r2", Finish({}, 60, ("a1",)), races.save_mark("r2", 1, "t1"))
    races.save("r2", {"n": 1}, 1, trip, "t1")
    assert races.live_jobs("r2") == {} and races.last_seen_ms("r2") is None
    assert races.records.length() == 1  # no record given, none appended


def test_state_keys_expire_eventually(redis_client, prefix):
    store = RaceStore(redis_client, prefix, Keeping(state_ttl_s=120))
    store.create("r1", {})
    assert 100_000 < redis_client.pttl(RaceShards(prefix).race("r1").state) <= 120_000


def _increment(url: str, prefix: str, race_id: str, times: int, barrier) -> None:
    store = RaceStore(redis_from_url(url, decode_responses=True), prefix)
    barrier.wait(10)
    for _ in range(times):
        store.update(race_id, lambda s: {"n": s["n"] + 1}, attempts=1000)


def test_concurrent_processes_never_lose_an_update(redis_url, races, prefix):
    races.create("counter", {"n": 0})
    barrier = ctx.Barrier(4)
    procs = [
        ctx.Process(target=_increment, args=(redis_url, prefix, "counter", 50, barrier))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    record = races.load("counter")
    assert record.state == {"n": 200}
    assert record.version == 201  # every save advanced exactly one version


def test_update_gives_up_after_its_attempts(races):
    races.create("r", {"n": 0})

    def meddle(state):
        # Someone else saves between our load and our save, every time.
        current = races.load("r")
        races.save("r", {"n": current.state["n"] + 100}, current.version)
        return {"n": state["n"] + 1}

    with pytest.raises(StoreError, match="gave up after 3"):
        races.update("r", meddle, attempts=3)


# -- the winner ----------------------------------------------------------------------------------


def _claim(url: str, prefix: str, race_ids: list[str], attempt: str, barrier, out) -> None:
    store = RaceStore(redis_from_url(url, decode_responses=True), prefix)
    barrier.wait(10)
    for race_id in race_ids:
        claim = store.claim_winner(race_id, attempt)
        again = store.claim_winner(race_id, attempt)  # a redelivered claim
        out.put((race_id, attempt, claim.won, claim.first, claim.winner, again.won))


def test_exactly_one_winner_among_concurrent_processes(redis_url, races, prefix):
    race_ids = [f"race{i}" for i in range(25)]
    barrier = ctx.Barrier(6)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_claim, args=(redis_url, prefix, race_ids, f"att{k}", barrier, out))
        for k in range(6)
    ]
    for p in procs:
        p.start()
    rows = [out.get(timeout=60) for _ in range(6 * len(race_ids))]
    for p in procs:
        p.join(10)
    for race_id in race_ids:
        mine = [r for r in rows if r[0] == race_id]
        winners = [r for r in mine if r[2]]
        assert len(winners) == 1, mine
        (_, attempt, _, first, _, again) = winners[0]
        assert first and again
        assert {r[4] for r in mine} == {attempt}  # everyone is told the same winner
        assert races.winner(race_id) == attempt
        assert not any(r[5] for r in mine if r[1] != attempt)


def test_winner_claim_is_idempotent_and_final(races):
    assert races.winner("r") is None
    first = races.claim_winner("r", "runpod-1")
    assert (first.won, first.first, first.winner) == (True, True, "runpod-1")
    again = races.claim_winner("r", "runpod-1")
    assert (again.won, again.first) == (True, False)
    other = races.claim_winner("r", "modal-2")
    assert (other.won, other.winner) == (False, "runpod-1")
    with pytest.raises(ValueError, match="attempt id"):
        races.claim_winner("r", "")


# -- ownership, heartbeats and the janitor index -------------------------------------------------


def test_ownership_lease_with_fencing_tokens(races):
    coordinator = races.claim_owner("r", "coord-a", lease_ms=200)
    assert coordinator.token > 0
    assert races.claim_owner("r", "janitor", lease_ms=5000) is None
    # re-entrant: the same token
    assert races.claim_owner("r", "coord-a", lease_ms=200).token == coordinator.token
    races.renew_owner(coordinator, lease_ms=200)
    wait_for(lambda: races.owner("r") is None, 5, "the lease to lapse")
    janitor = races.claim_owner("r", "janitor", lease_ms=5000)
    assert janitor.token > coordinator.token
    with pytest.raises(OwnershipLost) as info:
        races.renew_owner(coordinator, lease_ms=200)
    assert isinstance(info.value, LeaseError)
    assert races.release_owner(coordinator) is False
    assert races.owner("r") == janitor
    assert races.release_owner(janitor) is True
    assert races.owner("r") is None
    with pytest.raises(ValueError, match="owner name"):
        races.claim_owner("r", "a|b", 100)


def test_owner_tokens_never_go_back_when_a_failover_loses_the_counter(races, redis_client, prefix):
    keys = RaceShards(prefix).race("r")
    old = races.claim_owner("r", "coord-a", lease_ms=60_000)
    # a lossy failover: the new primary has neither the lease nor the counter's last writes
    redis_client.delete(keys.owner, keys.owner_seq)
    time.sleep(0.002)  # the floor is Redis's ms x 1000: the same ms gives the same floor
    new = races.claim_owner("r", "coord-b", lease_ms=60_000)
    assert new.token > old.token
    # the same token issued to another owner (the counter taken back by hand) is not ours
    redis_client.set(keys.owner, f"{old.token}|coord-b", px=60_000)
    with pytest.raises(OwnershipLost):
        races.renew_owner(old, lease_ms=60_000)
    assert races.release_owner(old) is False
    assert redis_client.get(keys.owner) == f"{old.token}|coord-b"


def test_the_fencing_counter_expires_with_its_race_never_before_its_lease(redis_client, prefix):

    races = RaceStore(redis_client, prefix, Keeping(receipt_ttl_s=60, state_ttl_s=3600))
    races.create("live", {"n": 1})
    races.claim_owner("live", "coord", lease_ms=1000)
    seq = RaceShards(prefix).race("live").owner_seq
    state_ttl = redis_client.pttl(RaceShards(prefix).race("live").state)
    # as the state's: the script reads the state's PTTL and then sets the counter's, and Redis's
    # clock may tick a millisecond between the two, so the counter can outlive the state by
    # 1 ms (the safe side: a live race never sees its fencing counter start again)
    assert 0 < state_ttl - 1000 <= redis_client.pttl(seq) <= state_ttl + 1
    # a janitor claiming a race whose keys expired already (its finish dropped them): the
    # counter it creates must not stay for ever
    races.claim_owner("gone", "janitor", lease_ms=1000)
    assert 59_000 < redis_client.pttl(RaceShards(prefix).race("gone").owner_seq) <= 60_000
    races.claim_owner("brief", "janitor", lease_ms=90_000)  # never before the lease
    assert redis_client.pttl(RaceShards(prefix).race("brief").owner_seq) > 89_000


def test_stale_races_are_found_and_owned_or_fresh_ones_are_not(redis_client, prefix):
    now = time.time()
    old = RaceStore(redis_client, prefix, clock=VirtualClock(now - 120))
    fresh = RaceStore(redis_client, prefix)
    old.add_job("dead", "a1", {"provider": "runpod", "job_id": "j-1"})
    old.add_job("dead", "a2", {"provider": "modal", "job_id": "fc-2"})
    old.add_job("owned", "a1", {"provider": "runpod", "job_id": "j-3"})
    old.touch("quiet")
    fresh.add_job("alive", "a1", {"provider": "runpod", "job_id": "j-4"})
    lease = fresh.claim_owner("owned", "slow-coordinator", lease_ms=30_000)

    stale = {s.race_id: s for s in fresh.stale_races(stale_ms=60_000)}
    assert set(stale) == {"dead", "quiet"}
    assert stale["dead"].live_jobs == {
        "a1": {"provider": "runpod", "job_id": "j-1"},
        "a2": {"provider": "modal", "job_id": "fc-2"},
    }
    assert stale["quiet"].live_jobs == {}
    assert abs(stale["dead"].last_seen_ms - (now - 120) * 1000) < 1000

    fresh.release_owner(lease)  # the slow coordinator is gone now
    assert {s.race_id for s in fresh.stale_races(stale_ms=60_000)} == {"dead", "owned", "quiet"}
    # A heartbeat never moves backwards (a host with a slow clock).
    fresh.touch("dead")
    old.touch("dead")
    assert "dead" not in {s.race_id for s in fresh.stale_races(stale_ms=60_000)}
    assert {s.race_id for s in fresh.stale_races(stale_ms=60_000, limit=1)} <= {"owned", "quiet"}


def _coordinate(url: str, prefix: str, race_id: str, started) -> None:
    store = RaceStore(redis_from_url(url, decode_responses=True), prefix)
    lease = store.claim_owner(race_id, f"coord-{os.getpid()}", lease_ms=2000)
    store.add_job(race_id, "primary", {"provider": "sim", "job_id": "sim-1"})
    started.set()
    while True:
        store.renew_owner(lease, lease_ms=2000)
        time.sleep(0.1)


def test_janitor_finds_a_race_whose_coordinator_was_killed(redis_url, races, prefix):
    started = ctx.Event()
    proc = ctx.Process(target=_coordinate, args=(redis_url, prefix, "r9", started))
    proc.start()
    try:
        assert started.wait(20)
        time.sleep(1.0)
        # Alive: its lease is renewed and its heartbeat is fresh, however slow it may be.
        assert races.stale_races(stale_ms=1000) == []
        alive = races.owner("r9")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
    wait_for(lambda: races.stale_races(stale_ms=1000), 15, "the janitor to see the dead race")
    (stale,) = races.stale_races(stale_ms=1000)
    assert stale.race_id == "r9"
    assert stale.live_jobs == {"primary": {"provider": "sim", "job_id": "sim-1"}}
    janitor = races.claim_owner("r9", "janitor-1", lease_ms=5000)
    assert alive is not None and janitor is not None and janitor.token > alive.token


# -- receipts ------------------------------------------------------------------------------------


def test_finish_keeps_the_receipt_for_its_ttl_then_everything_expires(redis_client, races):
    races.create("r", {"phase": "won"})
    races.claim_winner("r", "a1")
    races.add_job("r", "a2", {"provider": "sim", "job_id": "j"})
    assert races.remove_job("r", "a2") is True
    assert races.remove_job("r", "a2") is False
    receipt = {"race_id": "r", "winner": "a1", "wasted_usd": 0.0012, "leaks": 0}
    assert races.finish("r", receipt, ttl_s=2.0) == 0  # long enough for a loaded machine
    assert races.receipt("r") == receipt
    assert races.last_seen_ms("r") is None  # nothing live left: out of the janitor's index
    keys = RaceShards(races.prefix).race("r")
    assert 0 < redis_client.pttl(keys.receipt) <= 2000
    assert 0 < redis_client.pttl(keys.state) <= 2000
    wait_for(lambda: races.receipt("r") is None, 10, "the receipt to expire")
    assert races.load("r") is None and races.winner("r") is None


def test_finish_with_a_live_job_leaves_the_race_to_the_janitor(races):
    races.create("r", {})
    races.add_job("r", "a2", {"provider": "sim", "job_id": "j"})
    heartbeat = races.last_seen_ms("r")
    assert races.finish("r", {"leaks": 1}) == 1
    assert races.last_seen_ms("r") == heartbeat  # still there, as stale as it was


def test_finish_drops_ended_jobs_in_its_own_round_trip(races):
    races.create("r", {})
    for attempt in ("a1", "a2", "a3"):
        races.add_job("r", attempt, {"provider": "sim", "job_id": attempt})
    assert races.finish("r", {"leaks": 1}, drop_jobs=["a1", "a2"]) == 1  # a3 is still live
    assert list(races.live_jobs("r")) == ["a3"] and races.last_seen_ms("r") is not None
    assert races.finish("r", {"leaks": 0}, drop_jobs=["a3"]) == 0
    assert races.live_jobs("r") == {} and races.last_seen_ms("r") is None


def test_the_request_is_stored_once_beside_the_state_and_dropped_at_finish(redis_client, prefix):
    store = RaceStore(redis_client, prefix, Keeping(state_ttl_s=120))
    request = {"text": "x" * 10_000, "n": [1, 2]}
    assert store.create("r", {"phase": "primary"}, request) == 1
    keys = RaceShards(prefix).race("r")
    assert store.load("r").state == {"phase": "primary"}  # not in the state steps rewrite
    assert redis_client.get(keys.request) == '{"text":"' + "x" * 10_000 + '","n":[1,2]}'
    assert 100_000 < redis_client.pttl(keys.request) <= 120_000
    assert store.request("r") == request
    # a redelivered create conflicts and leaves the first request in place
    with pytest.raises(VersionConflict):
        store.create("r", {"phase": "other"}, {"text": "other"})
    assert store.request("r") == request
    store.save("r", {"phase": "hedged"}, 1)
    assert store.request("r") == request  # saves never touch it
    # the submit claim reads it in the same round trip
    assert store.claim_submit_with_request("r", "a1", {"submitting": True, "at": 1}) == (
        None,
        request,
    )
    # another claimer (its own intent: intents carry their time) gets what the first recorded
    found, again = store.claim_submit_with_request("r", "a1", {"submitting": True, "at": 2})
    assert found == {"submitting": True, "at": 1} and again == request
    assert store.finish("r", {"winner": "a1"}, ttl_s=60) == 1  # a1's intent is still live
    assert store.request("r") is None and not redis_client.exists(keys.request)
    assert store.claim_submit_with_request("r", "a2", {"submitting": True}) == (None, None)


def test_finish_lists_the_race_among_the_recently_finished(redis_client, races, monkeypatch):
    from gpuhedge_celery.store import race_receipts as races_module
    from gpuhedge_celery.store.race_lookup import races_starting_with, recently_finished

    monkeypatch.setattr(races_module, "RECENT_FINISHED", 3)
    for i in range(5):
        races.create(f"r{i}", {})
        races.finish(f"r{i}", {"race_id": f"r{i}"}, ttl_s=60)
    newest = [race_id for race_id, _ in recently_finished(races)]
    assert newest == ["r4", "r3", "r2"]  # the newest three, newest first
    assert 0 < redis_client.pttl(races.shards.index_of("r").finished) <= 60_000
    assert races_starting_with(races, "r") == ["r2", "r3", "r4"]  # the index answers first
    assert races_starting_with(races, "r0") == ["r0"]  # else the keys still in Redis
    assert races_starting_with(races, "nope") == []
    races.delete("r4")
    assert [race_id for race_id, _ in recently_finished(races)] == ["r3", "r2"]


def test_load_with_jobs_reads_state_and_jobs_together(races):
    assert races.load_with_jobs("nope") == (None, {})
    races.create("r", {"x": 1})
    races.add_job("r", "a1", {"provider": "sim", "job_id": "j"})
    record, jobs = races.load_with_jobs("r")
    assert (record.version, record.state, jobs) == (1, {"x": 1}, races.live_jobs("r"))


def test_receipt_ttl_is_configurable(redis_client, prefix):
    store = RaceStore(redis_client, prefix, Keeping(receipt_ttl_s=300))
    store.put_receipt("r", {"ok": True})
    assert 290_000 < redis_client.pttl(RaceShards(prefix).race("r").receipt) <= 300_000
    assert store.receipt("r") == {"ok": True}
    assert store.receipt("missing") is None
    with pytest.raises(ValueError, match="receipt_ttl_s"):
        RaceStore(redis_client, prefix, Keeping(receipt_ttl_s=0))


# -- keys and input ------------------------------------------------------------------------------


@pytest.mark.parametrize("race_id", ["", "a{b}", "with space", "x" * 201])
def test_bad_race_ids_are_rejected(races, race_id):
    with pytest.raises(ValueError, match="race id"):
        races.create(race_id, {})


def test_state_must_be_a_json_dict(races):
    with pytest.raises(ValueError, match="must be a dict"):
        races.create("r", ["not", "a", "dict"])
    with pytest.raises(ValueError, match="JSON"):
        races.create("r", {"x": {1, 2}})
    assert races.load("r") is None


def test_unreachable_redis_is_store_unavailable(private_redis):
    from gpuhedge_celery.errors import StoreUnavailable

    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    store = RaceStore(client, "p")
    private_redis.stop()
    with pytest.raises(StoreUnavailable):
        store.load("r")


def test_store_scripts_also_run_on_fakeredis(fake_redis):
    # The demo runs on an embedded fakeredis server: the same scripts must work there.
    from gpuhedge_celery.store.timers import TimerStore

    store = RaceStore(fake_redis, "demo")
    assert store.create("r", {"n": 0}) == 1
    assert store.save("r", {"n": 1}, 1) == 2
    with pytest.raises(VersionConflict) as info:
        store.save("r", {"n": 5}, 1)
    assert (info.value.found.version, info.value.found.state) == (2, {"n": 1})
    assert store.claim_winner("r", "a").first
    assert not store.claim_winner("r", "b").won
    first = store.claim_owner("r", "coord", 1000)
    assert first is not None and first.token > 0
    store.add_job("r", "a", {"job_id": "j"})
    assert store.finish("r", {"ok": True}) == 1
    timers = TimerStore(fake_redis, "demo")
    timers.arm("r|hedge", 100, {"k": 1})
    (timer,) = timers.claim_due(100, 10, 1000)
    assert timers.ack(timer) and timers.claim_due(10_000, 10, 1000) == []


def test_save_is_one_round_trip_and_survives_a_script_flush(private_redis):
    # A save is the hottest command of a race step: its pipeline must not ask SCRIPT EXISTS
    # first (redis-py does that for scripts called on a pipeline), and a server that forgot the
    # script (restart, SCRIPT FLUSH) must get it loaded again rather than fail the step.
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    store = RaceStore(client, "p")
    assert store.create("r", {"n": 0}) == 1
    client.config_resetstat()
    for n in range(1, 21):
        assert store.save("r", {"n": n}, n) == n + 1
    stats = client.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 20
    assert "cmdstat_script|exists" not in stats and "cmdstat_script" not in stats
    client.script_flush()
    assert store.save("r", {"n": 21}, 21) == 22
    assert store.load("r").state == {"n": 21}
    with pytest.raises(VersionConflict):
        store.save("r", {"n": 0}, 21)


def test_a_process_reads_its_own_last_save_without_a_round_trip_but_never_trusts_it(
    redis_client, prefix
):
    mine, other = RaceStore(redis_client, prefix), RaceStore(redis_client, prefix)
    assert mine.create("r", {"n": 0}) == 1
    cached = mine.load("r", fresh=True)
    assert cached.cached and (cached.version, cached.state) == (1, {"n": 0})
    assert not mine.load("r").cached  # a plain load always reads Redis
    assert other.load("r", fresh=True).cached is False  # nothing saved by that process
    other.save("r", {"n": 1}, 1)
    stale = mine.load("r", fresh=True)
    assert stale.cached and stale.version == 1  # stale: only a versioned save may use it
    with pytest.raises(VersionConflict):
        mine.save("r", {"n": 2}, stale.version)
    assert mine.load("r", fresh=True).cached is False  # the conflict dropped the copy
    assert mine.load("r").state == {"n": 1}


def test_the_fresh_copy_never_goes_back_to_an_older_version(redis_client, prefix):
    """Two threads' saves may reach the fresh-copy update out of order: the newer one stays."""
    store = RaceStore(redis_client, prefix)
    store.create("r1", {"step": 1})
    store.save("r1", {"step": 2}, 1)
    late = store.encode("r1", {"step": 1})
    store.copies.keep_saved("r1", Copy(1, "first", late.parts))  # the first save arriving late
    found = store.load("r1", fresh=True)
    assert found.cached and found.version == 2 and found.state == {"step": 2}
