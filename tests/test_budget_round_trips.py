"""Budgets cost no Redis round trip on one Redis: the reservation rides in the submit claim's
pipeline and each settlement in the save of the step that ended its attempt. On a Redis Cluster
(``[cluster]``) they follow the won claim or save in round trips of their own, and cost nothing
more.

The same races run through the race driver (real Redis, sim providers, no Celery) with budgets
off and on, counting every round trip (a command, or a pipeline's execute).
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.budget import BudgetCaps
from gpuhedge_celery.race.attempts import SubmitHow
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store.budget import BudgetStore
from gpuhedge_celery.store.connection import redis_from_url
from gpuhedge_celery.store.round_trip import RoundTrip
from tests.test_races_driver import Recorder, build_driver
from tests.test_watch_batch import RoundTrips

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]

FAST = {"sim": {"p": {"queue_s": 0, "run_s": 0}, "h": {"queue_s": 0, "run_s": 0}}}
CAPS = BudgetCaps(max_usd_per_request=10, max_usd_per_day=100, ceiling_usd=1000)


def trips_of_a_race(redis_url, prefix, policy, budget: bool, monkeypatch) -> tuple[int, int, int]:
    """Round trips of one race after two to warm up, those of the riders sent after a won save
    among them (none on one Redis), and the attempts it submitted."""
    client = redis_from_url(redis_url, decode_responses=True)
    driver, effects, cfg, ledger, _ = build_driver(client, prefix, Recorder())
    if budget:
        driver.budget = RaceBudget(BudgetStore(client, prefix), CAPS)
    spec = build_spec(cfg, policy)
    for warm in ("w1", "w2"):  # scripts loaded, connections made
        driver.create(f"{warm}-{budget}", FAST, spec, submit_first=True)
        for race_id, attempt_id in effects.launched:
            driver.submit_attempt(race_id, attempt_id, SubmitHow(decided_here=True))
        effects.launched.clear()
    with monkeypatch.context() as patched:
        trips, after_won = RoundTrips(patched), [0]
        send_won = RoundTrip.send_won

        def counted(trip, to):
            before = trips.count
            send_won(trip, to)
            after_won[0] += trips.count - before

        patched.setattr(RoundTrip, "send_won", counted)
        race_id = f"r-{budget}"
        driver.create(race_id, FAST, spec, submit_first=True)
        for rid, attempt_id in effects.launched:  # the hedge, as a launch thread would
            driver.submit_attempt(rid, attempt_id, SubmitHow(decided_here=True))
    receipt = driver.store.receipt(race_id)
    assert receipt is not None and receipt["winner"] is not None
    submitted = sum(1 for a in receipt["attempts"] if a["handle"])
    assert after_won[0] <= 2 * len(receipt["attempts"])  # a reservation, a settling save each
    client.close()
    return trips.count, after_won[0], submitted


@pytest.mark.parametrize("policy", ["single", "hedge:p->h@0s"])
def test_budgets_add_no_round_trip(redis_url, prefix, policy, monkeypatch, on_cluster):
    off, _, submits_off = trips_of_a_race(redis_url, prefix, policy, False, monkeypatch)
    on, after_won, submits_on = trips_of_a_race(redis_url, prefix, policy, True, monkeypatch)
    assert submits_on == submits_off >= 1
    # a cluster pipeline keeps to the race's slot: each reservation, and a save's settlements,
    # follow the won claim or save in a round trip of their own (the ledger's slot)
    assert after_won > 0 if on_cluster else after_won == 0
    assert on == off + after_won, (off, on, after_won)
    ledger = BudgetStore(redis_from_url(redis_url, decode_responses=True), prefix)
    settled = [e for _, e in ledger.entries() if e["type"] == "settle" and e["race"] == "r-True"]
    assert len(settled) == submits_on and ledger.open_count() == 0


def test_the_first_submits_claim_rides_in_the_create_and_only_a_create_that_wins_makes_it(
    redis_client, prefix
):
    driver, effects, cfg, ledger, _ = build_driver(redis_client, prefix, Recorder())
    driver.budget = RaceBudget(BudgetStore(redis_client, prefix), CAPS)
    claims = []
    claim = driver.store.claim_submit_with_request
    driver.store.claim_submit_with_request = lambda *a, **k: claims.append(a) or claim(*a, **k)
    spec = build_spec(cfg, "single")
    request = {"sim": {"p": {"queue_s": 5, "run_s": 100}}}
    assert driver.create("c1", request, spec, submit_first=True)
    assert claims == []  # no claim round trip of its own: it rode in the create
    assert driver.store.live_jobs("c1")["a1"]["job_id"]  # submitted once and registered
    assert int(ledger.get("sim:seq:p") or 0) == 1
    budget = driver.budget.store
    reserved = [e for _, e in budget.entries() if e["type"] == "reserve" and e["race"] == "c1"]
    assert [e["attempt"] for e in reserved] == ["a1"] and budget.open_count() == 1
    # A redelivered create loses to the first: it claims and reserves nothing, though the
    # claim and the reservation were in its pipeline. (Both made by the first are taken away,
    # so that one made now would show.)
    redis_client.hdel(driver.store.shards.race("c1").jobs, "a1")  # on the driver's shards
    redis_client.delete(budget.keys.reservation("c1/a1"))
    redis_client.zrem(budget.keys.open, "c1/a1")
    entries = len(list(budget.entries()))
    assert not driver.create("c1", request, spec, submit_first=True)
    assert driver.store.live_jobs("c1") == {} and claims == []
    assert len(list(budget.entries())) == entries and budget.open_count() == 0


def test_a_reservation_lost_after_the_create_is_sent_again_before_the_first_submit(
    redis_client, prefix, monkeypatch
):
    """On a cluster the first attempt's reservation follows the create in a round trip of its
    own; when that one is lost, the submit sends the reservation again rather than failing."""
    from gpuhedge_celery.store import round_trip

    monkeypatch.setattr(round_trip, "_one_slot", lambda pipe: True)  # split, as on a cluster
    monkeypatch.setattr(round_trip.RoundTrip, "send_won", lambda self, client: None)  # lost
    driver, effects, cfg, ledger, _ = build_driver(redis_client, prefix, Recorder())
    driver.budget = RaceBudget(BudgetStore(redis_client, prefix), CAPS)
    spec = build_spec(cfg, "single")
    assert driver.create("l1", {"sim": {"p": {"queue_s": 5, "run_s": 100}}}, spec,
                         submit_first=True)  # fmt: skip
    assert driver.store.live_jobs("l1")["a1"]["job_id"]  # submitted, once
    assert int(ledger.get("sim:seq:p") or 0) == 1
    budget = driver.budget.store
    reserved = [e for _, e in budget.entries() if e["type"] == "reserve" and e["race"] == "l1"]
    assert [e["attempt"] for e in reserved] == ["a1"] and budget.open_count() == 1
