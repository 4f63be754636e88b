"""Budgets cost no Redis round trip: the reservation rides in the submit claim's pipeline and
each settlement in the save of the step that ended its attempt.

The same races run through the race driver (real Redis, sim providers, no Celery) with budgets
off and on, on a client that counts every round trip (a command, or a pipeline's execute).
"""

from __future__ import annotations

import pytest
import redis

from gpuhedge_celery.core.budget import BudgetCaps
from gpuhedge_celery.race.attempts import SubmitHow
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store.budget import BudgetStore
from gpuhedge_celery.store.race_keys import RaceShards
from tests.test_races_driver import Recorder, build_driver

pytestmark = pytest.mark.timeout(60)

FAST = {"sim": {"p": {"queue_s": 0, "run_s": 0}, "h": {"queue_s": 0, "run_s": 0}}}
CAPS = BudgetCaps(max_usd_per_request=10, max_usd_per_day=100, ceiling_usd=1000)


class CountingPipeline(redis.client.Pipeline):
    def execute(self, raise_on_error: bool = True):
        self.counter[0] += 1
        return super().execute(raise_on_error)


class CountingRedis(redis.Redis):
    """A client that counts its round trips."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trips = [0]

    def execute_command(self, *args, **options):
        self.trips[0] += 1
        return super().execute_command(*args, **options)

    def pipeline(self, transaction=True, shard_hint=None):
        pipe = CountingPipeline(self.connection_pool, self.response_callbacks, transaction,
                                shard_hint)  # fmt: skip
        pipe.counter = self.trips
        return pipe


def trips_of_a_race(redis_url, prefix, policy, budget: bool) -> tuple[int, int]:
    client = CountingRedis.from_url(redis_url, decode_responses=True)
    driver, effects, cfg, ledger, _ = build_driver(client, prefix, Recorder())
    if budget:
        driver.budget = RaceBudget(BudgetStore(client, prefix), CAPS)
    spec = build_spec(cfg, policy)
    for warm in ("w1", "w2"):  # scripts loaded, connections made
        driver.create(f"{warm}-{budget}", FAST, spec, submit_first=True)
        for race_id, attempt_id in effects.launched:
            driver.submit_attempt(race_id, attempt_id, SubmitHow(decided_here=True))
        effects.launched.clear()
    client.trips[0] = 0
    race_id = f"r-{budget}"
    driver.create(race_id, FAST, spec, submit_first=True)
    for rid, attempt_id in effects.launched:  # the hedge, as a launch thread would
        driver.submit_attempt(rid, attempt_id, SubmitHow(decided_here=True))
    receipt = driver.store.receipt(race_id)
    assert receipt is not None and receipt["winner"] is not None
    submitted = sum(1 for a in receipt["attempts"] if a["handle"])
    return client.trips[0], submitted


@pytest.mark.parametrize("policy", ["single", "hedge:p->h@0s"])
def test_budgets_add_no_round_trip(redis_url, prefix, policy):
    off, submits_off = trips_of_a_race(redis_url, prefix, policy, budget=False)
    on, submits_on = trips_of_a_race(redis_url, prefix, policy, budget=True)
    assert submits_on == submits_off >= 1
    assert on == off, (off, on)
    ledger = BudgetStore(redis.Redis.from_url(redis_url, decode_responses=True), prefix)
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
    redis_client.hdel(RaceShards(prefix).race("c1").jobs, "a1")
    redis_client.delete(budget.keys.reservation("c1/a1"))
    redis_client.zrem(budget.keys.open, "c1/a1")
    entries = len(list(budget.entries()))
    assert not driver.create("c1", request, spec, submit_first=True)
    assert driver.store.live_jobs("c1") == {} and claims == []
    assert len(list(budget.entries())) == entries and budget.open_count() == 0
