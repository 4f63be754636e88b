"""A settlement that rides in a race save settles only if that save wins, on a real Redis and
(``[cluster]``) a Redis Cluster.

A step decides from its copy of the race; when its save loses the version check, that copy
was out of date, and so may be the figure its settlement carries. A reservation settles once,
so the figure would stick: the settlement must run only with a save that won. On one Redis it
rides in the save's pipeline and checks the save's mark; on a cluster (the ledger on a slot of
its own) it is sent once the save won, in a round trip of its own. No workers: the race store
and the ledger are driven directly, each save with the settlement its step queued, then the
race driver of two processes, one of them on a stale copy of the race.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.attempts import Attempt
from gpuhedge_celery.core.budget import BudgetCaps, to_nano
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.race import Race
from gpuhedge_celery.core.race_events import ResultArrived
from gpuhedge_celery.race.attempts import SubmitHow
from gpuhedge_celery.race.base import RaceParts
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.race.driver import RaceDriver
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store.budget import BudgetStore
from gpuhedge_celery.store.race_keys import reservation_id
from gpuhedge_celery.store.races import RaceStore, VersionConflict, new_save_id
from gpuhedge_celery.store.round_trip import RoundTrip
from gpuhedge_celery.store.scripts import run_pipeline
from tests.test_races_driver import Recorder, build_driver, race_stores
from tests.test_watch_batch import RoundTrips

pytestmark = [pytest.mark.timeout(30), pytest.mark.cluster]

SPEC = {"caps_s": {"p": 100.0}, "rates": {"p": {"rate_per_s": 0.001, "idle_s": 20.0}}}
WORST = to_nano(0.12, round_up=True)  # 100 s x $0.001 + 20 s idle
STALE, FRESH = to_nano(0.0807), to_nano(0.0776)  # billed to the end seen, to the cancel


@pytest.fixture
def stores(redis_client, prefix):
    races, ledger = RaceStore(redis_client, prefix), BudgetStore(redis_client, prefix)
    budget = RaceBudget(ledger, BudgetCaps(ceiling_usd=10), VirtualClock(1_900_000_000))
    for aid in ("a1", "a2"):
        a = Attempt(id=aid, provider="p", role="primary", launched_at=0.0)
        assert ledger.reserve(budget.reservation("r1", a, {"spec": SPEC})).granted
    races.create("r1", {"step": 0})
    return races, ledger


def save_settling(races, ledger, state, version, items, save_id=None):
    """A step's save from ``version``, carrying the settlement of ``items`` (attempt, nano)."""
    save_id = save_id or new_save_id()
    mark = races.save_mark("r1", version, save_id)

    def settle(pipe, known):  # known: sent after the save won (a cluster's)
        found = [(aid, nano, "estimated") for aid, nano in items]
        ledger.queue_settle(pipe, "r1", found, 1, only_if=None if known else mark)

    trip = RoundTrip()
    trip.ride_won(settle, [ledger.settle_script])
    return races.save("r1", state, version, trip, save_id)


def settlements(ledger):
    """The ledger's settlements, in order: (attempt, nano-dollars)."""
    return [(e["attempt"], int(e["nano"])) for _, e in ledger.entries() if e["type"] == "settle"]


def is_open(ledger, aid):
    record = ledger.reservation("r1", aid)
    indexed = ledger.client.zscore(ledger.keys.open, reservation_id("r1", aid)) is not None
    return "settled" not in record and indexed


def test_a_save_that_loses_leaves_the_reservation_open_and_the_winners_figure_sticks(stores):
    races, ledger = stores
    races.save("r1", {"step": "cancel sent"}, 1)  # another step saved first: v2
    # this step worked from v1 (no cancel there): it billed a1 to the end it saw, and lost
    with pytest.raises(VersionConflict):
        save_settling(races, ledger, {"step": "ended, stale"}, 1, [("a1", STALE)])
    assert is_open(ledger, "a1") and settlements(ledger) == []
    assert ledger.counters(["all"])["all"] == (2 * WORST, 0)
    # decided again on v2: billed to its cancel, and that save wins
    assert save_settling(races, ledger, {"step": "ended"}, 2, [("a1", FRESH)]) == 3
    assert not is_open(ledger, "a1") and settlements(ledger) == [("a1", FRESH)]
    assert int(ledger.reservation("r1", "a1")["settled"]) == FRESH
    assert ledger.counters(["all"])["all"] == (WORST, FRESH)


def test_a_loser_that_read_the_winners_version_settles_nothing(stores):
    # Both read v1 and both would make v2: the race's version alone cannot tell them apart,
    # so the check names the save itself.
    races, ledger = stores
    assert save_settling(races, ledger, {"step": "winner"}, 1, [("a1", FRESH)]) == 2
    with pytest.raises(VersionConflict):
        save_settling(races, ledger, {"step": "loser"}, 1, [("a2", STALE)])
    assert settlements(ledger) == [("a1", FRESH)] and is_open(ledger, "a2")


def test_a_won_save_sent_again_settles_once(stores):
    races, ledger = stores
    # a save whose answer was lost, sent again with the same id: answered saved, settles once
    assert save_settling(races, ledger, {"step": 1}, 1, [("a1", FRESH)], save_id="x1") == 2
    assert save_settling(races, ledger, {"step": 1}, 1, [("a1", STALE)], save_id="x1") == 2
    assert settlements(ledger) == [("a1", FRESH)]


@pytest.mark.one_redis  # on a Redis Cluster a settlement follows its won save: no mark to find
def test_a_settlement_checked_after_later_saves_finds_its_save_in_the_history(stores):
    races, ledger = stores
    mark = races.save_mark("r1", 1, "x2")
    races.save("r1", {"step": 2}, 1, save_id="x2")
    races.save("r1", {"step": 3}, 2)

    def settle(pipe):
        ledger.queue_settle(pipe, "r1", [("a2", STALE, "estimated")], 1, only_if=mark)

    assert run_pipeline(ledger.client, settle, [ledger.settle_script]) == [[1, STALE]]
    assert settlements(ledger) == [("a2", STALE)]


def test_a_settlement_costs_a_round_trip_of_its_own_on_a_cluster_only(
    stores, monkeypatch, on_cluster
):
    races, ledger = stores
    races.save("r1", {"step": 1}, 1)  # scripts loaded, connections made
    save_settling(races, ledger, {"step": 2}, 2, [("a1", FRESH)])
    trips = RoundTrips(monkeypatch)
    races.save("r1", {"step": 3}, 3)
    alone, trips.count = trips.count, 0
    assert save_settling(races, ledger, {"step": 4}, 4, [("a2", STALE)]) == 5
    settling, trips.count = trips.count, 0
    with pytest.raises(VersionConflict):
        save_settling(races, ledger, {"step": "late"}, 4, [("a2", FRESH)])
    lost = trips.count
    # a cluster pipeline keeps to the race's slot: the ledger's settlement follows the won save
    assert (alone, settling, lost) == (1, 2 if on_cluster else 1, 1)
    assert settlements(ledger) == [("a1", FRESH), ("a2", STALE)]


def test_a_step_on_a_stale_copy_settles_what_the_saved_race_implies(redis_client, prefix):
    """Through the race driver: this process cached the race with both attempts running;
    another process saw the hedge win (the primary cancelled). The primary's result is then
    seen CANCELLED here: on the stale copy (no cancel known, no winner) someone else stopped
    it; the save loses, the step is decided again on Redis's copy, where our cancel stopped
    it (priced to the end that sighting shows), and the ledger settles that figure."""
    slow = {"sim": {"p": {"queue_s": 0, "run_s": 1000}, "h": {"queue_s": 0, "run_s": 1000}}}
    caps, ledger = BudgetCaps(ceiling_usd=1000), BudgetStore(redis_client, prefix)
    here, effects, cfg, _, providers = build_driver(redis_client, prefix, Recorder())
    other = RaceDriver(RaceParts(
        *race_stores(redis_client, prefix),
        providers.__getitem__, Recorder(), RaceSettings(),
    ))  # fmt: skip
    here.budget = other.budget = RaceBudget(ledger, caps)
    here.create("r1", slow, build_spec(cfg, "hedge:p->h@0s"), submit_first=True)
    for race_id, attempt_id in effects.launched:
        here.submit_attempt(race_id, attempt_id, SubmitHow(decided_here=True))
    assert here.store.load("r1", fresh=True).cached  # both running, in this process's copy
    other.step("r1", ResultArrived("a2"))  # h wins there: p is cancelled
    here.step("r1", ResultArrived("a1", JobState.CANCELLED, valid=False))
    saved = here.store.load("r1")
    race = Race.from_dict(saved.state["race"], here.clock)
    p = race.attempts[0]
    assert race.winner == "a2" and 0 < p.cancel_sent_at < p.result_at  # Redis's copy decided
    assert p.receipt is not None and p.receipt.confirmed_terminal  # our cancel, confirmed
    ((_, implied, source),) = here.budget.settlements(race, saved.state, [p])
    assert source == "estimated" and implied > 0
    assert [nano for aid, nano in settlements(ledger) if aid == "a1"] == [implied]
    assert int(ledger.reservation("r1", "a1")["settled"]) == implied
