"""A race's winner and a budget reservation count only once replicas hold them (Redis WAIT,
``GPUHEDGE_REDIS_WAIT_REPLICAS``).

The race driver (sim providers, no Celery, as in test_races_driver.py) on private redis-servers:
one with no replica, where ``WAIT 1`` always comes back 0, so a winner must never be published
nor a reserved job launched; and a primary with one replica on loopback, where the same races
run as usual, the ``WAIT`` riding in the round trips they already make, and a replica frozen
mid-race (``SIGSTOP``) holds the winner back until it is thawed and the step retried.

An outcome the replicas did not hold at first is told later all the same: by the race's tell
timer (armed ahead of the deciding save, so durable even when that step also finished the
race), a webhook's retry, a batched step's resume or the janitor; a winner never held by the
deadline fails its caller explicitly and is never published after; a failure is told only
once the replicas hold the save that gave up (or past the deadline and a grace: never silence).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
import time

import pytest
import redis
from prometheus_client import REGISTRY

from gpuhedge_celery.core.budget import BudgetCaps
from gpuhedge_celery.core.race import Race
from gpuhedge_celery.errors import StoreUnavailable
from gpuhedge_celery.metrics import record as metrics
from gpuhedge_celery.race.attempts import SubmitHow
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.race.janitor import Janitor, JanitorOptions
from gpuhedge_celery.race.outcome import TELL_MAX_TRIES, UNHELD
from gpuhedge_celery.race.receipt import result_key
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.race.watch_batch import WatchBatch
from gpuhedge_celery.store.budget import BudgetStore
from gpuhedge_celery.store.race_keys import RaceShards, SaveMark
from gpuhedge_celery.store.races import RaceStore, WinnerClaim
from gpuhedge_celery.store.replicas import NotAcknowledged, ReplicaAcks
from gpuhedge_celery.webhooks.apply import apply_delivery
from tests.support.redis_server import RedisServer, start_redis_server
from tests.test_races_driver import Recorder, Writing, build_driver, submissions
from tests.test_watch_batch import RoundTrips, handled, started_and_due

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]

PREFIX = "t"
FAST = {"sim": {"p": {"queue_s": 0, "run_s": 0}, "h": {"queue_s": 0, "run_s": 0}}}
SLOW = {"sim": {"p": {"queue_s": 5, "run_s": 100}}}
CAPS = BudgetCaps(max_usd_per_request=10, max_usd_per_day=100, ceiling_usd=1000)
COUNTED = {"on_short": metrics.replica_wait_short}  # as the workers build it
SHORT = ReplicaAcks(1, 50, **COUNTED)  # a WAIT that no replica answers costs 50 ms


def short_waits(what: str, outcome: str) -> float:
    labels = {"what": what, "outcome": outcome}
    return REGISTRY.get_sample_value("gpuhedge_replica_wait_short_total", labels) or 0.0


def client_of(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, decode_responses=True)


class Telling(Writing):
    """Writing effects that also keep the caller's dict of each failure."""

    def __init__(self, prefix) -> None:
        super().__init__(prefix)
        self.failed_callers: list[dict] = []

    def failed(self, race_id, message, receipt, caller):
        self.failed_callers.append({**caller, "failure_reason": receipt.get("failure_reason")})
        super().failed(race_id, message, receipt, caller)


class Later:
    """A clock ``by`` seconds ahead of the wall's."""

    def __init__(self, by: float) -> None:
        self.by = by

    def now(self) -> float:
        return time.time() + self.by


def replicated_driver(client, acks: ReplicaAcks, budget: bool = False):
    """A driver (Writing effects: the caller's result key is ``t:caller:<race>``) whose store,
    and budget when asked for, wait for ``acks``."""
    driver, effects, cfg, ledger, providers = build_driver(client, PREFIX, Telling(PREFIX))
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


HEDGE_WINS = {"sim": {"p": {"queue_s": 0, "run_s": 100}, "h": {"queue_s": 0, "run_s": 0}}}


def abandoned_with_a_winner(driver, cfg, race_id: str, deadline_s: float = 60.0) -> None:
    """A hedged race whose hedge won (claimed with no replica asked for) and whose primary's
    cancel was never sent: its coordinator died, for the janitor to find."""
    spec = dataclasses.replace(build_spec(cfg, "hedge:p->h@0s"), deadline_s=deadline_s)
    driver.create(race_id, HEDGE_WINS, spec)
    driver.submit_attempt(race_id, "a1")
    driver.submit_attempt(race_id, "a2")
    assert driver.store.winner(race_id) == "a2" and driver.store.receipt(race_id) is None


def janitor_of(driver, ledger, cfg, effects, clock=None) -> Janitor:
    providers = {name: cfg.build(name, ledger=ledger) for name in cfg.providers}
    options = JanitorOptions(stale_ms=1, coordinators_alive=lambda: False, clock=clock)
    time.sleep(0.01)  # stale
    return Janitor(driver.store, driver.timers, providers.__getitem__, effects, options)


def test_the_janitor_hands_over_no_winner_the_replicas_do_not_hold(lone):
    driver, effects, cfg, ledger = replicated_driver(lone, ReplicaAcks())
    abandoned_with_a_winner(driver, cfg, "r7")
    published = len(effects.results)
    # its coordinator gone, the janitor finds the race with a winner nobody may have been told
    driver.store.acks = SHORT
    janitor = janitor_of(driver, ledger, cfg, effects)
    assert janitor.clean("r7").action == "skipped: its winner is not held by the replicas yet"
    assert len(effects.results) == published and driver.store.receipt("r7") is None
    driver.store.acks = ReplicaAcks()  # held now: ended, and the winner handed over
    assert janitor.clean("r7").action == "ended"
    assert len(effects.results) == published + 1 and effects.results[-1]["attempt"] == "a2"


def test_a_claim_whose_save_was_lost_is_not_confirmed(lone):
    store = RaceStore(lone, PREFIX, acks=SHORT)
    state_key = RaceShards(PREFIX).race("gone").state
    ridden = WinnerClaim(won=True, winner="a1", first=True)
    with pytest.raises(NotAcknowledged, match="no longer in Redis"):
        store.confirm_winner("gone", "a1", SaveMark(state_key, "3:lost"), ridden, 0)
    assert store.winner("gone") is None  # sent again, it claimed nothing


def tell_timers(driver, race_id: str) -> list[str]:
    """The ids of the race's tell timers waiting."""
    timers = driver.timers.of(race_id)
    ids = timers.client.zrange(timers.keys.due, 0, -1)
    return [t for t in ids if t.startswith(f"{race_id}|tell|")]


def fire(driver, kind: str, race_id: str) -> None:
    """Claim the race's due timers of ``kind`` as if it were an hour later, and fire them."""
    now = int(time.time() * 1000) + 3_600_000
    found = [
        t
        for t in driver.timers.of(race_id).claim_due(now, 100, 10_000)
        if t.payload["kind"] == kind and t.payload["race"] == race_id
    ]
    assert found, f"no {kind} timer of {race_id}"
    for timer in found:
        driver.on_timer(timer)


def test_at_the_deadline_a_winner_never_held_fails_its_caller_and_is_never_published(lone):
    driver, effects, cfg, _ = replicated_driver(lone, SHORT)
    driver.create("r1", FAST, build_spec(cfg, "single"))
    with pytest.raises(NotAcknowledged):
        driver.submit_attempt("r1", "a1")  # the step declares a1 and finishes the race
    assert tell_timers(driver, "r1") == ["r1|tell|0"]  # armed ahead of the save
    driver.clock = Later(60)  # the deadline (2.4 s) has passed when the tell timer fires
    fire(driver, "tell", "r1")
    assert effects.results == [] and len(effects.failures) == 1
    assert "its winner a1 was not acknowledged by 1 Redis replica(s)" in effects.failures[0]
    assert effects.failed_callers[0]["failure_reason"] == "unacknowledged"
    assert effects.failed_callers[0]["tell_once"] is True  # Celery effects: told only once
    assert driver.store.load("r1").state[UNHELD]["winner"] == "a1"
    assert tell_timers(driver, "r1") == []  # nothing more to tell
    # The claim counts at last (no replica asked for any more): never published after that
    driver.store.acks = ReplicaAcks()
    driver.resume("r1")
    assert effects.results == [] and len(effects.failures) == 1


def test_a_failure_is_told_only_once_the_replicas_hold_the_save_that_gave_up(lone):
    driver, effects, cfg, _ = replicated_driver(lone, SHORT)
    driver.create("r2", SLOW, build_spec(cfg, "single"))  # a job that never ends in time
    driver.submit_attempt("r2", "a1")
    driver.clock = Later(4)  # past the deadline (2.4 s), within its grace (5 s)
    with pytest.raises(NotAcknowledged, match="the save that failed it"):
        fire(driver, "policy", "r2")  # the deadline: the race gives up
    assert driver.store.load("r2").state["race"]["gave_up"] is True
    assert effects.failures == [] and tell_timers(driver, "r2") == ["r2|tell|0"]
    fire(driver, "tell", "r2")  # still not held: told again later
    assert effects.failures == [] and tell_timers(driver, "r2") == ["r2|tell|1"]
    driver.clock = Later(60)  # past the grace: told all the same, never silence
    fire(driver, "tell", "r2")
    assert len(effects.failures) == 1 and "no valid result within" in effects.failures[0]
    assert effects.failed_callers[0]["tell_once"] is True
    assert effects.results == [] and tell_timers(driver, "r2") == []


def test_the_janitor_fails_the_caller_of_a_winner_never_held_by_its_deadline(lone):
    driver, effects, cfg, ledger = replicated_driver(lone, ReplicaAcks())
    abandoned_with_a_winner(driver, cfg, "r8", deadline_s=1.0)
    published = len(effects.results)
    driver.store.acks = SHORT
    janitor = janitor_of(driver, ledger, cfg, effects)
    # within the deadline's grace the failure itself waits for the replicas
    janitor.clock = Later(2)
    assert janitor.clean("r8").action == "skipped: its end is not held by the replicas yet"
    assert effects.failures == []
    janitor.clock = Later(60)
    cleanup = janitor.clean("r8")
    assert (cleanup.action, cleanup.failed) == ("finalised", True)
    assert len(effects.results) == published and len(effects.failures) == 1
    assert "its winner a2 was not acknowledged" in effects.failures[0]
    assert driver.store.receipt("r8")["failure_reason"] == "unacknowledged"


def test_the_janitor_tells_a_failure_only_once_the_replicas_hold_it(lone):
    driver, effects, cfg, ledger = replicated_driver(lone, SHORT)
    driver.create("r9", SLOW, build_spec(cfg, "single"))
    driver.submit_attempt("r9", "a1")
    janitor = janitor_of(driver, ledger, cfg, effects)
    assert janitor.clean("r9").action == "skipped: its end is not held by the replicas yet"
    assert effects.failures == [] and driver.store.receipt("r9") is None
    janitor.clock = Later(60)  # past the deadline and its grace: told all the same
    cleanup = janitor.clean("r9")
    assert (cleanup.action, cleanup.failed) == ("finalised", True)
    assert len(effects.failures) == 1 and driver.store.receipt("r9")["finished"] is True


def test_a_batched_step_left_unfinished_hands_back_only_its_race_with_a_resume(
    redis_client, prefix, monkeypatch
):
    driver, effects, cfg, _, _ = build_driver(redis_client, prefix, Recorder())
    races = ["k1", "k2", "k3"]
    _, timers = started_and_due(driver, cfg, races)
    performed, perform = [], driver.perform

    def perform_short_for_k1(step):
        performed.append(step.race_id)
        follow = perform(step)
        if step.race_id == "k1":  # as a winner the replicas do not hold would
            raise NotAcknowledged("race k1: 0 of 1 replicas acknowledged it")
        return follow

    monkeypatch.setattr(driver, "perform", perform_short_for_k1)
    resumed = []
    monkeypatch.setattr(driver, "resume", resumed.append)
    back = handled(WatchBatch(driver), timers)
    assert sorted(performed) == races  # the races after k1 were performed all the same
    (timer, work), k1 = back[0], [t for t in timers if t.payload["race"] == "k1"]
    assert len(back) == 1 and timer is k1[0] and isinstance(work, functools.partial)
    work()  # on a timer thread: k1 is resumed (its retry tells its outcome again)
    assert resumed == ["k1"]
    assert effects.events.count("running") == len(races)


# -- one replica ----------------------------------------------------------------------------


def test_with_a_replica_the_winner_is_published_once_after_it_holds_it(replicated):
    client, _ = replicated
    driver, effects, cfg, _ = replicated_driver(client, ReplicaAcks(1, 2000, **COUNTED))
    retried = short_waits("winner", "retried")
    driver.create("r1", FAST, build_spec(cfg, "hedge:p->h@0s"))
    for race_id, attempt_id in list(effects.launched):
        driver.submit_attempt(race_id, attempt_id, SubmitHow(decided_here=True))
    assert len(effects.results) == 1 and effects.events.count("won") == 1
    won = effects.results[0]["attempt"]
    assert driver.store.winner("r1") == won
    # written by the effects, once, after they read that nothing was told before
    assert effects.callers[0]["tell_once"] is True and "first_claim" not in effects.callers[0]
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
    while follower.get(driver.store.shards.race("r1").winner) != "a1":  # it catches up
        assert time.monotonic() < deadline, "the thawed replica never got the claim"
        time.sleep(0.02)
    driver.store.acks = ReplicaAcks(
        1, 2000, **COUNTED
    )  # a loaded machine's replica may answer slowly
    driver.resume("r1")  # the step's retry, the replica back
    assert [r["attempt"] for r in effects.results] == ["a1"]
    follower.close()


def round_trips(url: str, acks: ReplicaAcks, race_id: str) -> tuple[int, int]:
    """Round trips of one budgeted race whose job ends at once, and its winners published."""
    client = redis.Redis.from_url(url, decode_responses=True)
    driver, effects, cfg, _ = replicated_driver(client, acks, budget=True)
    spec = build_spec(cfg, "single")
    driver.create(f"{race_id}-warm", FAST, spec, submit_first=True)  # scripts loaded
    with pytest.MonkeyPatch.context() as patched:
        trips = RoundTrips(patched)
        driver.create(race_id, FAST, spec, submit_first=True)
    assert driver.store.receipt(race_id)["winner"] == "a1"
    client.close()
    return trips.count, len(effects.results)


def test_a_winner_and_a_reservation_held_by_a_replica_cost_one_round_trip_more(replicated):
    client, _ = replicated
    url = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
    off = round_trips(url, ReplicaAcks(), "off")
    on = round_trips(url, ReplicaAcks(1, 2000, **COUNTED), "on")
    # the WAITs ride in the pipelines already sent; the one more: the tell-once decision,
    # after the claim's WAIT (a failure at the deadline may not decide between it and the tell)
    assert on == (off[0] + 1, off[1]) and on[1] == 2


def test_a_ridden_claim_its_wait_short_is_sent_again_and_counts_once_held(replicated):
    client, _ = replicated
    store = RaceStore(client, PREFIX, acks=ReplicaAcks(1, 2000, **COUNTED))
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


def frozen(replica: RedisServer) -> None:
    """Freeze the replica (SIGSTOP): it stays connected but acknowledges nothing."""
    os.kill(replica.process.pid, signal.SIGSTOP)


def thawed(replica: RedisServer, key: str, value: str) -> None:
    """Thaw the replica and wait until it holds ``key`` = ``value``."""
    os.kill(replica.process.pid, signal.SIGCONT)
    follower = client_of(replica)
    deadline = time.monotonic() + 10
    while follower.get(key) != value:
        assert time.monotonic() < deadline, "the thawed replica never caught up"
        time.sleep(0.02)
    follower.close()


def long_single(cfg):
    return dataclasses.replace(build_spec(cfg, "single"), deadline_s=60)


def test_a_winner_the_replicas_held_late_is_told_by_the_tell_timer(replicated):
    client, replica = replicated
    driver, effects, cfg, _ = replicated_driver(client, ReplicaAcks(1, 100))
    driver.create("r1", FAST, long_single(cfg))
    frozen(replica)
    try:
        with pytest.raises(NotAcknowledged):
            driver.submit_attempt("r1", "a1")
        # the same step finished the race: out of the live index, the janitor never sees it
        assert driver.store.receipt("r1")["finished"] is True
        assert client.zscore(driver.store.shards.index_of("r1").live, "r1") is None
        assert effects.results == [] and tell_timers(driver, "r1") == ["r1|tell|0"]
        fire(driver, "tell", "r1")  # still frozen: told again later
        assert effects.results == [] and tell_timers(driver, "r1") == ["r1|tell|1"]
    finally:
        thawed(replica, driver.store.shards.race("r1").winner, "a1")
    driver.store.acks = ReplicaAcks(
        1, 2000, **COUNTED
    )  # a loaded machine's replica may answer slowly
    fire(driver, "tell", "r1")
    assert [r["attempt"] for r in effects.results] == ["a1"] and effects.failures == []
    assert tell_timers(driver, "r1") == []


def test_an_outcome_told_at_once_leaves_no_tell_timer(replicated):
    client, _ = replicated
    driver, effects, cfg, _ = replicated_driver(client, ReplicaAcks(1, 2000, **COUNTED))
    driver.create("r2", FAST, long_single(cfg))
    driver.submit_attempt("r2", "a1")
    assert len(effects.results) == 1 and tell_timers(driver, "r2") == []
    driver.create("r3", SLOW, build_spec(cfg, "single"))
    driver.submit_attempt("r3", "a1")
    driver.clock = Later(4)
    fire(driver, "policy", "r3")  # the deadline: given up, held, told at once
    assert len(effects.failures) == 1 and tell_timers(driver, "r3") == []


class Hooked:
    """A sim provider whose job's end is also delivered by webhook (the sim's own result)."""

    def __init__(self, provider) -> None:
        self.provider = provider

    def __getattr__(self, name):
        return getattr(self.provider, name)

    def webhook_result(self, handle, body):
        return self.provider.result(handle, 1.0)


def test_a_webhook_retry_declares_a_winner_the_replicas_did_not_hold_at_first(replicated, caplog):
    client, replica = replicated
    driver, effects, cfg, _ = replicated_driver(client, ReplicaAcks(1, 100))
    providers = driver.providers
    driver.providers = lambda name: Hooked(providers(name))
    driver.create("r4", {"sim": {"p": {"queue_s": 0, "run_s": 10}}}, long_single(cfg))
    driver.submit_attempt("r4", "a1")  # polled once: it runs 100 ms more
    time.sleep(0.2)
    frozen(replica)
    try:
        with caplog.at_level("WARNING", logger="gpuhedge_celery.webhooks.apply"):
            # saved, not published; then the provider's retry: the sender is told only to
            # retry, the replicas' shortfall is in the receiver's log
            saved = apply_delivery(driver, "r4", "a1", {})
            assert driver.store.winner("r4") == "a1" and effects.results == []
            retried = apply_delivery(driver, "r4", "a1", {})
        assert saved == retried == (503, {"error": "try again"})
        logged = [r.getMessage() for r in caplog.records if r.name.endswith("webhooks.apply")]
        assert len(logged) == 2 and all("not held by the Redis replicas" in m for m in logged)
    finally:
        thawed(replica, driver.store.shards.race("r4").winner, "a1")
    driver.store.acks = ReplicaAcks(1, 2000, **COUNTED)
    status, answer = apply_delivery(driver, "r4", "a1", {})  # and its next one
    assert status == 200 and "declared again" in answer["ignored"]
    assert [r["attempt"] for r in effects.results] == ["a1"]


def test_the_janitor_claims_again_a_winner_whose_claim_a_failover_lost(replicated):
    client, _ = replicated
    driver, effects, cfg, ledger = replicated_driver(client, ReplicaAcks())
    abandoned_with_a_winner(driver, cfg, "r5")
    published = len(effects.results)
    client.delete(driver.store.shards.race("r5").winner)  # a failover kept the save, not the claim
    driver.store.acks = ReplicaAcks(1, 2000, **COUNTED)
    janitor = janitor_of(driver, ledger, cfg, effects)
    assert janitor.clean("r5").action == "ended"
    assert driver.store.winner("r5") == "a2"  # claimed again, held
    assert len(effects.results) == published + 1 and effects.results[-1]["attempt"] == "a2"


def test_the_janitor_follows_the_attempt_that_holds_the_claim(replicated):
    client, _ = replicated
    driver, effects, cfg, ledger = replicated_driver(client, ReplicaAcks())
    abandoned_with_a_winner(driver, cfg, "r6")
    published = len(effects.results)
    # The claim names another attempt than the state (no step makes that: a failover's
    # leftovers), whose result is stored: that one is handed over, and only that one
    client.set(driver.store.shards.race("r6").winner, "a1")
    client.set(
        result_key(driver.store.shards, "r6", "a1"),
        client.get(result_key(driver.store.shards, "r6", "a2")),
    )
    driver.store.acks = ReplicaAcks(1, 2000, **COUNTED)
    janitor = janitor_of(driver, ledger, cfg, effects)
    assert janitor.clean("r6").action == "ended"
    assert len(effects.results) == published + 1
    assert (effects.results[-1]["attempt"], effects.results[-1]["winner"]) == ("a1", "p")
    receipt = driver.store.receipt("r6")  # it says what the caller was told
    assert receipt["winner"] == "a1" and receipt.get("failure_reason") is None


def test_the_janitor_fails_the_caller_when_the_claims_holder_has_no_result(replicated):
    client, _ = replicated
    driver, effects, cfg, ledger = replicated_driver(client, ReplicaAcks())
    abandoned_with_a_winner(driver, cfg, "r9")
    published = len(effects.results)
    client.set(driver.store.shards.race("r9").winner, "a1")  # a holder whose result is gone
    driver.store.acks = ReplicaAcks(1, 2000, **COUNTED)
    janitor = janitor_of(driver, ledger, cfg, effects)
    cleanup = janitor.clean("r9")
    assert (cleanup.action, cleanup.failed) == ("ended", True)  # never silence
    assert len(effects.results) == published and len(effects.failures) == 1
    assert "the result of a1, which holds the winner claim, is gone" in effects.failures[0]
    assert effects.failed_callers[0]["failure_reason"] == "winner_result_lost"
    assert driver.store.told("r9") == "failed"
    receipt = driver.store.receipt("r9")  # it says what the caller was told
    assert receipt["winner"] is None and receipt["failure_reason"] == "winner_result_lost"


class Backend(Telling):
    """Effects that tell the caller as the Celery ones do: the result backend's status read,
    then written (not atomic); ``between`` runs between the two, where a rival teller may."""

    def __init__(self, prefix) -> None:
        super().__init__(prefix)
        self.status = "PENDING"
        self.error_callbacks = 0
        self.between = lambda: None

    def won(self, race_id, result, caller):
        if self.status in (("SUCCESS", "FAILURE") if caller.get("tell_once") else ("SUCCESS",)):
            return
        self.rival()
        self.status = "SUCCESS"
        super().won(race_id, result, caller)

    def failed(self, race_id, message, receipt, caller):
        if self.status == "FAILURE" or (self.status == "SUCCESS" and caller.get("tell_once")):
            return
        self.rival()
        if self.status != "SUCCESS":  # Celery keeps a success, but runs the error links
            self.status = "FAILURE"
        self.error_callbacks += 1
        super().failed(race_id, message, receipt, caller)

    def rival(self) -> None:
        rival, self.between = self.between, lambda: None  # it comes between once
        rival()


def won_untold(lone, monkeypatch, race_id: str):
    """A race whose winner a1 is saved but not yet told (its claim's WAIT came back short),
    its state as a step read it, on a driver whose claims now count as held."""
    driver, _, cfg, _ = replicated_driver(lone, SHORT)
    effects = driver.effects = Backend(PREFIX)
    driver.create(race_id, FAST, long_single(cfg))
    with pytest.raises(NotAcknowledged):
        driver.submit_attempt(race_id, "a1")
    assert effects.status == "PENDING"
    held = WinnerClaim(won=True, winner="a1", first=False)
    monkeypatch.setattr(driver.store, "claim_winner", lambda *_: held)  # the replicas hold it
    state = driver.store.load(race_id).state
    return driver, effects, Race.from_dict(state["race"], driver.clock), state


def test_a_winner_and_a_failure_told_at_once_reach_the_caller_once(lone, monkeypatch):
    # the winner's declare reaches the telling first; the deadline's failure comes between
    # its read of the backend and its write
    driver, effects, race, state = won_untold(lone, monkeypatch, "t1")
    effects.between = lambda: driver.outcome._fail_unheld("t1", race)
    assert driver.outcome.declare("t1", race, state)["attempt"] == "a1"
    assert effects.status == "SUCCESS" and len(effects.results) == 1
    assert effects.failures == [] and effects.error_callbacks == 0
    assert UNHELD not in driver.store.load("t1").state  # its receipt shows no failure
    # the failure first: the winner's declare (its state read before) comes between
    driver, effects, race, state = won_untold(lone, monkeypatch, "t2")
    effects.between = lambda: driver.outcome.declare("t2", race, state)
    driver.outcome._fail_unheld("t2", race)
    assert effects.status == "FAILURE" and effects.results == []
    assert len(effects.failures) == 1 and effects.error_callbacks == 1
    driver.outcome.declare("t2", race, state)  # a later retry tells nothing either
    assert effects.results == [] and len(effects.failures) == 1


def test_a_failure_decided_but_not_told_is_told_by_the_next_tell(lone, monkeypatch):
    driver, effects, race, state = won_untold(lone, monkeypatch, "t3")
    assert driver.store.tell_once("t3", "failed") == "failed"  # its teller stopped right there
    driver.outcome.retell("t3", 0)  # the claim is held now, but the failure was decided
    assert effects.status == "FAILURE" and effects.results == []
    assert effects.failed_callers[0]["failure_reason"] == "unacknowledged"


def test_without_a_deadline_a_winner_never_held_is_failed_after_the_last_tell(lone):
    driver, effects, cfg, _ = replicated_driver(lone, SHORT)
    driver.create("t4", FAST, long_single(cfg))
    with pytest.raises(NotAcknowledged):
        driver.submit_attempt("t4", "a1")

    def no_deadline(state):
        return {**state, "race": {**state["race"], "deadline_s": None}}

    driver.store.update("t4", no_deadline)
    driver.clock = Later(3600)
    driver.outcome.retell("t4", 0)  # not held: told again later, whatever the time
    assert effects.failures == [] and tell_timers(driver, "t4") == ["t4|tell|0", "t4|tell|1"]
    driver.outcome.retell("t4", TELL_MAX_TRIES - 1)  # the last: failed explicitly
    assert effects.results == [] and len(effects.failures) == 1
    assert effects.failed_callers[0]["failure_reason"] == "unacknowledged"


def test_a_failure_is_decided_for_the_caller_only_once_the_replicas_hold_the_decision(
    replicated,
):
    client, replica = replicated
    store = RaceStore(client, PREFIX, acks=ReplicaAcks(1, 100, tries=30, backoff_s=0.01))
    store.create("d1", {"n": 0})
    frozen(replica)
    decided: list = []
    teller = threading.Thread(target=lambda: decided.append(store.tell_once("d1", "failed")))
    teller.start()
    teller.join(0.5)
    assert teller.is_alive() and decided == []  # a lossy failover now could take it back
    os.kill(replica.process.pid, signal.SIGCONT)
    teller.join(10)
    assert decided == ["failed"]
    follower = client_of(replica)
    assert follower.hget(RaceShards(PREFIX).race("d1").state, "told") == "failed"
    follower.close()
    # a winner decided after it is refused, and needs no wait of its own
    assert store.tell_once("d1", "won") == "failed"


def test_a_failure_the_replicas_never_hold_is_still_decided_for_the_caller(lone):
    store = RaceStore(lone, PREFIX, acks=ReplicaAcks(1, 20, **COUNTED, tries=2, backoff_s=0.01))
    store.create("d2", {"n": 0})
    gave_up = short_waits("failure", "gave_up")
    assert store.tell_once("d2", "failed") == "failed"  # never silence
    assert short_waits("failure", "gave_up") == gave_up + 1
    assert store.tell_once("d2", "won") == "failed"
