"""A race's winner and a budget reservation count only once replicas hold them (Redis WAIT,
``GPUHEDGE_REDIS_WAIT_REPLICAS``).

The race driver (sim providers, no Celery, as in test_races_driver.py) on private redis-servers:
one with no replica, where ``WAIT 1`` always comes back 0, so a winner must never be published
nor a reserved job launched; and a primary with one replica on loopback, where the same races
run as usual, the ``WAIT`` riding in the round trips they already make, and a replica frozen
mid-race (``SIGSTOP``) holds the winner back until it is thawed and the step retried.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
from prometheus_client import REGISTRY

from gpuhedge_celery.core.budget import BudgetCaps
from gpuhedge_celery.errors import StoreUnavailable
from gpuhedge_celery.race.attempts import SubmitHow
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.race.janitor import Janitor, JanitorOptions
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store.budget import BudgetStore
from gpuhedge_celery.store.race_keys import SaveMark, race_keys
from gpuhedge_celery.store.races import RaceStore, WinnerClaim
from gpuhedge_celery.store.replicas import NotAcknowledged, ReplicaAcks
from tests.support.redis_server import RedisServer, start_redis_server
from tests.test_budget_round_trips import CountingRedis
from tests.test_races_driver import Writing, build_driver, submissions

pytestmark = pytest.mark.timeout(60)

PREFIX = "t"
FAST = {"sim": {"p": {"queue_s": 0, "run_s": 0}, "h": {"queue_s": 0, "run_s": 0}}}
SLOW = {"sim": {"p": {"queue_s": 5, "run_s": 100}}}
CAPS = BudgetCaps(max_usd_per_request=10, max_usd_per_day=100, ceiling_usd=1000)
SHORT = ReplicaAcks(1, 50)  # a WAIT that no replica answers costs 50 ms


def short_waits(what: str, outcome: str) -> float:
    labels = {"what": what, "outcome": outcome}
    return REGISTRY.get_sample_value("gpuhedge_replica_wait_short_total", labels) or 0.0


def client_of(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, decode_responses=True)


def replicated_driver(client, acks: ReplicaAcks, budget: bool = False):
    """A driver (Writing effects: the caller's result key is ``t:caller:<race>``) whose store,
    and budget when asked for, wait for ``acks``."""
    driver, effects, cfg, ledger, providers = build_driver(client, PREFIX, Writing(PREFIX))
    driver.store.acks = acks
    if budget:
        driver.budget = RaceBudget(BudgetStore(client, PREFIX, acks=acks), CAPS)
    return driver, effects, cfg, ledger


@pytest.fixture
def lone(private_redis):
    """A redis-server with no replica: WAIT 1 answers 0 after its timeout."""
    client = client_of(private_redis)
    assert client.info("replication")["connected_slaves"] == 0
    yield client
    client.close()


def replica_online(primary: redis.Redis, replica: redis.Redis) -> bool:
    info = primary.info("replication")
    return (
        info.get("connected_slaves", 0) >= 1
        and info["slave0"]["state"] == "online"
        and replica.info("replication").get("master_link_status") == "up"
    )


@pytest.fixture
def replicated():
    """A primary and one replica of it on loopback: (primary client, replica server)."""
    primary = start_redis_server("--repl-diskless-sync-delay", "0")  # no 5 s wait to sync
    replica = start_redis_server("--replicaof", "127.0.0.1", str(primary.port))
    client, follower = client_of(primary), client_of(replica)
    try:
        deadline = time.monotonic() + 10
        while not replica_online(client, follower):
            assert time.monotonic() < deadline, "the replica never came online"
            time.sleep(0.02)
        yield client, replica
    finally:
        os.kill(replica.process.pid, signal.SIGCONT)  # a test may leave it frozen
        client.close()
        follower.close()
        replica.stop()
        primary.stop()


# -- no replica: nothing counts --------------------------------------------------------------


def test_with_no_replica_to_hold_it_a_winner_is_never_published(lone):
    driver, effects, cfg, _ = replicated_driver(lone, SHORT)
    gave_up = short_waits("winner", "gave_up")
    driver.create("r1", FAST, build_spec(cfg, "single"))
    with pytest.raises(StoreUnavailable, match="0 of 1 replicas acknowledged it"):
        driver.submit_attempt("r1", "a1")  # the job ends at once: its step declares a1
    assert driver.store.winner("r1") == "a1"  # claimed on the primary...
    assert effects.results == [] and "won" not in effects.events  # ...but nobody was told
    assert lone.get(f"{PREFIX}:caller:r1") is None  # nor was the result written by the claim
    assert short_waits("winner", "gave_up") == gave_up + 1
    with pytest.raises(NotAcknowledged):
        driver.resume("r1")  # the step's retry: still nobody holds it, still unpublished
    assert effects.results == []
    # Once the claim counts (here: no replica asked for any more) the retry publishes it, once,
    # and the claim it publishes is the one already made
    driver.store.acks = ReplicaAcks()
    driver.resume("r1")
    assert [r["attempt"] for r in effects.results] == ["a1"] and driver.store.winner("r1") == "a1"


def test_with_no_replica_asked_for_the_same_server_runs_races_as_before(lone):
    driver, effects, cfg, _ = replicated_driver(lone, ReplicaAcks())
    driver.create("r2", FAST, build_spec(cfg, "single"))
    driver.submit_attempt("r2", "a1")
    assert [r["winner"] for r in effects.results] == ["p"]
    # the caller's result rides in the claim, as it always has
    assert effects.callers[0]["result_stored"] is True
    assert lone.get(f"{PREFIX}:caller:r2") is not None


def test_with_no_replica_to_hold_it_no_job_is_launched_on_a_reservation(lone):
    driver, effects, cfg, ledger = replicated_driver(lone, SHORT, budget=True)
    spec = build_spec(cfg, "single")
    gave_up = short_waits("reservation", "gave_up")
    # the first submit, its claim and reservation riding in the create
    with pytest.raises(NotAcknowledged, match="budget reservation r1/a1"):
        driver.create("r1", SLOW, spec, submit_first=True)
    # a submit that claims on its own
    driver.create("r2", SLOW, spec)
    with pytest.raises(NotAcknowledged, match="budget reservation r2/a1"):
        driver.submit_attempt("r2", "a1", SubmitHow(decided_here=True))
    assert submissions(ledger) == 0  # nothing reached the provider
    assert short_waits("reservation", "gave_up") == gave_up + 2
    # Our submit intents were taken back (nothing was submitted), so a retry claims afresh:
    # here on a server that no longer needs a replica, it submits once, on the same reservation
    assert driver.store.live_jobs("r1") == {} and driver.store.live_jobs("r2") == {}
    driver.budget.store.acks = ReplicaAcks()
    driver.submit_attempt("r2", "a1", SubmitHow(decided_here=True))
    assert submissions(ledger) == 1 and driver.store.live_jobs("r2")["a1"]["job_id"]
    reserved = [e for _, e in driver.budget.store.entries() if e["type"] == "reserve"]
    assert sorted(e["race"] for e in reserved) == ["r1", "r2"]  # each reserved once


def test_the_janitor_hands_over_no_winner_the_replicas_do_not_hold(lone):
    driver, effects, cfg, ledger = replicated_driver(lone, ReplicaAcks())
    providers = {name: cfg.build(name, ledger=ledger) for name in cfg.providers}
    request = {"sim": {"p": {"queue_s": 0, "run_s": 100}, "h": {"queue_s": 0, "run_s": 0}}}
    driver.create("r7", request, build_spec(cfg, "hedge:p->h@0s"))
    driver.submit_attempt("r7", "a1")
    driver.submit_attempt("r7", "a2")  # the hedge wins; the primary's cancel is never sent
    assert driver.store.winner("r7") == "a2" and driver.store.receipt("r7") is None
    published = len(effects.results)
    # its coordinator gone, the janitor finds the race with a winner nobody may have been told
    driver.store.acks = SHORT
    options = JanitorOptions(stale_ms=1, coordinators_alive=lambda: False)
    janitor = Janitor(driver.store, driver.timers, providers.__getitem__, effects, options)
    time.sleep(0.01)
    assert janitor.clean("r7").action == "skipped: its winner is not held by the replicas yet"
    assert len(effects.results) == published and driver.store.receipt("r7") is None
    driver.store.acks = ReplicaAcks()  # held now: ended, and the winner handed over
    assert janitor.clean("r7").action == "ended"
    assert len(effects.results) == published + 1 and effects.results[-1]["attempt"] == "a2"


def test_a_claim_whose_save_was_lost_is_not_confirmed(lone):
    store = RaceStore(lone, PREFIX, acks=SHORT)
    state_key = race_keys(PREFIX, "gone").state
    ridden = WinnerClaim(won=True, winner="a1", first=True)
    with pytest.raises(NotAcknowledged, match="no longer in Redis"):
        store.confirm_winner("gone", "a1", SaveMark(state_key, "3:lost"), ridden, 0)
    assert store.winner("gone") is None  # sent again, it claimed nothing


# -- one replica ----------------------------------------------------------------------------


def test_with_a_replica_the_winner_is_published_once_after_it_holds_it(replicated):
    client, _ = replicated
    driver, effects, cfg, _ = replicated_driver(client, ReplicaAcks(1, 2000))
    retried = short_waits("winner", "retried")
    driver.create("r1", FAST, build_spec(cfg, "hedge:p->h@0s"))
    for race_id, attempt_id in list(effects.launched):
        driver.submit_attempt(race_id, attempt_id, SubmitHow(decided_here=True))
    assert len(effects.results) == 1 and effects.events.count("won") == 1
    won = effects.results[0]["attempt"]
    assert driver.store.winner("r1") == won
    assert effects.callers[0]["first_claim"] is True  # written by the effects, once
    assert "result_stored" not in effects.callers[0]
    assert short_waits("winner", "retried") == retried  # held at the first WAIT


def test_a_frozen_replica_holds_the_winner_back_until_it_answers_again(replicated):
    client, replica = replicated
    driver, effects, cfg, _ = replicated_driver(client, ReplicaAcks(1, 100))
    driver.create("r1", FAST, build_spec(cfg, "single"))
    os.kill(replica.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(NotAcknowledged):
            driver.submit_attempt("r1", "a1")
        assert effects.results == [] and client.get(f"{PREFIX}:caller:r1") is None
    finally:
        os.kill(replica.process.pid, signal.SIGCONT)
    follower = client_of(replica)
    deadline = time.monotonic() + 10
    while follower.get(race_keys(PREFIX, "r1").winner) != "a1":  # it catches up
        assert time.monotonic() < deadline, "the thawed replica never got the claim"
        time.sleep(0.02)
    driver.store.acks = ReplicaAcks(1, 2000)  # a loaded machine's replica may answer slowly
    driver.resume("r1")  # the step's retry, the replica back
    assert [r["attempt"] for r in effects.results] == ["a1"]
    follower.close()


def round_trips(url: str, acks: ReplicaAcks, race_id: str) -> tuple[int, int]:
    """Round trips of one budgeted race whose job ends at once, and its winners published."""
    client = CountingRedis.from_url(url, decode_responses=True)
    driver, effects, cfg, _ = replicated_driver(client, acks, budget=True)
    spec = build_spec(cfg, "single")
    driver.create(f"{race_id}-warm", FAST, spec, submit_first=True)  # scripts loaded
    client.trips[0] = 0
    driver.create(race_id, FAST, spec, submit_first=True)
    assert driver.store.receipt(race_id)["winner"] == "a1"
    return client.trips[0], len(effects.results)


def test_a_winner_and_a_reservation_held_by_a_replica_cost_no_extra_round_trip(replicated):
    client, _ = replicated
    url = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
    off = round_trips(url, ReplicaAcks(), "off")
    on = round_trips(url, ReplicaAcks(1, 2000), "on")
    assert on == off and on[1] == 2  # the WAITs ride in the pipelines already sent


def test_a_ridden_claim_its_wait_short_is_sent_again_and_counts_once_held(replicated):
    client, _ = replicated
    store = RaceStore(client, PREFIX, acks=ReplicaAcks(1, 2000))
    store.create("r1", {"race": {}}, save_id="s1")
    retried = short_waits("winner", "retried")
    # as if the claim rode in that save and its WAIT came back 0: sent again, marked the same
    ridden = WinnerClaim(won=True, winner="a1", first=True)
    claim = store.confirm_winner("r1", "a1", store.save_mark("r1", 0, "s1"), ridden, 0)
    assert claim == WinnerClaim(won=True, winner="a1", first=True)
    assert short_waits("winner", "retried") == retried + 1
    # another attempt's win is not ours to wait for: answered at once
    other = store.confirm_winner("r1", "a2", store.save_mark("r1", 0, "s1"), ridden, 0)
    assert other == WinnerClaim(won=False, winner="a1", first=False)
