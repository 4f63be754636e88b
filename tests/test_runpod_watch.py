"""The race watch's pacing seam for rate-budgeted providers, on a real Redis without Celery.

A provider with ``polls_before_decisions`` is polled just before each policy decision, and a
poll it defers with a reserved slot (``RateLimited.reserved``) is re-armed at that slot, with
the slot in the timer itself, so whichever process fires it spends it.
"""

from __future__ import annotations

import json
import time

import pytest

from gpuhedge_celery.config import parse_config_text
from gpuhedge_celery.core.race import DEADLINE_TIMER
from gpuhedge_celery.errors import RateLimited
from gpuhedge_celery.providers.simledger import RedisLedger
from gpuhedge_celery.race.base import JobRef, RaceParts
from gpuhedge_celery.race.driver import RaceDriver
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.race.watch import DECISION_LEAD_S
from tests.support.fixtures_races import RACE_CONFIG
from tests.test_races_driver import Recorder, race_stores

pytestmark = pytest.mark.timeout(60)

SLOW = {"sim": {"p": {"queue_s": 5, "run_s": 1000}}}  # provider seconds (x 0.01 real)


class Paced:
    """The sim provider ``p`` seen through a paced, budgeted status: the next poll 10 s out,
    and a deferral with a reserved slot when told."""

    polls_before_decisions = True

    def __init__(self, sim):
        self.sim, self.name = sim, sim.name
        self.defer_at: float | None = None
        self.spent: list[float | None] = []

    def __getattr__(self, name):
        return getattr(self.sim, name)

    def status_and_next_change(self, handle, reserved=None):
        self.spent.append(reserved)
        if self.defer_at is not None:
            error = RateLimited(self.name, "deferred: a slot is reserved", self.defer_at)
            error.reserved = True
            self.defer_at = None
            raise error
        return self.sim.status(handle), time.time() + 10.0


@pytest.fixture
def driver(redis_client, prefix):
    cfg = parse_config_text(RACE_CONFIG)
    ledger = RedisLedger(redis_client, prefix)
    providers = {name: cfg.build(name, ledger=ledger) for name in cfg.providers}
    providers["p"] = Paced(providers["p"])
    store, timers = race_stores(redis_client, prefix)
    d = RaceDriver(RaceParts(store, timers, providers.__getitem__, Recorder(), RaceSettings()))
    d.cfg, d.paced, d.client = cfg, providers["p"], redis_client
    return d


def watch_timer(d, race_id):
    """(due epoch s, payload) of the race's pending watch timer, taken (as a firing process
    would: the next one armed is then the only one)."""
    keys = d.timers.of(race_id).keys
    data = d.client.hgetall(keys.data)
    found = [json.loads(v) for v in data.values() if json.loads(v)["payload"]["race"] == race_id]
    found = [t for t in found if t["payload"]["kind"] == "watch"]
    assert len(found) == 1, found
    d.client.delete(keys.due, keys.data)
    return found[0]["due"] / 1000.0, found[0]["payload"]


def test_the_next_poll_comes_just_before_the_policy_decision(driver):
    driver.create("w1", SLOW, build_spec(driver.cfg))  # fixed: hedge at 30 s (0.3 s real)
    driver.submit_attempt("w1", "a1")
    race = driver.store.load("w1").state["race"]
    hedge_at, deadline_at = race["timers"]["hedge"], race["timers"][DEADLINE_TIMER]
    due, payload = watch_timer(driver, "w1")
    # the race's decisions ahead: the policy's hedge, then the race's deadline
    assert payload["decide"] == [hedge_at, deadline_at] and hedge_at < deadline_at
    # the provider said "in 10 s"; the hedge decision comes first: polled 0.25 s before it
    assert due == pytest.approx(hedge_at - DECISION_LEAD_S, abs=0.002)


def test_a_job_still_running_near_the_race_deadline_is_polled_just_before_it(driver):
    """The deadline is a decision too (the race gives up: a job seen finished just before it
    wins instead). Only a deadline shorter than the caps leaves a job running then."""
    text = RACE_CONFIG.replace(
        "  attempt_cap_s: 180\n", "  attempt_cap_s: 600\n  race_deadline_s: 300\n"
    )
    cfg = parse_config_text(text)
    assert cfg.race_deadline_for(["p", "h"]) < cfg.cap_s("p")
    driver.create("w3", SLOW, build_spec(cfg))  # hedge at 0.3 s real, deadline at 3 s
    driver.submit_attempt("w3", "a1")
    race = driver.store.load("w3").state["race"]
    hedge_at, deadline_at = race["timers"]["hedge"], race["timers"][DEADLINE_TIMER]
    due, payload = watch_timer(driver, "w3")
    assert due == pytest.approx(hedge_at - DECISION_LEAD_S, abs=0.002)
    # that poll, fired when due: the hedge is too close to poll for again, so the next poll
    # comes just before the deadline, sooner than the provider's "in 10 s"
    time.sleep(max(0.0, due - time.time()))
    driver.watcher.watch(JobRef.from_payload(payload), payload["last"], payload["decide"])
    assert time.time() < deadline_at - DECISION_LEAD_S  # (else there is no poll ahead to arm)
    due, payload = watch_timer(driver, "w3")
    assert due == pytest.approx(deadline_at - DECISION_LEAD_S, abs=0.002)


def test_a_deferred_poll_keeps_its_reserved_slot_in_the_timer_and_spends_it(driver):
    driver.create("w2", SLOW, build_spec(driver.cfg))
    driver.submit_attempt("w2", "a1")
    version = driver.store.load("w2").version
    _, payload = watch_timer(driver, "w2")
    slot = time.time() + 0.2
    driver.paced.defer_at = slot
    driver.watcher.watch(JobRef.from_payload(payload), payload["last"], payload.get("decide"))
    due, payload = watch_timer(driver, "w2")
    assert due == pytest.approx(slot, abs=0.002) and payload["reserved"] == slot
    assert driver.store.load("w2").version == version  # nothing was observed: no step
    # fired (by any process): the slot goes back to the provider to be spent
    ref = JobRef.from_payload(payload)
    driver.watcher.watch(ref, payload["last"], payload.get("decide"), payload.get("reserved"))
    assert driver.paced.spent[-2:] == [None, slot]
    assert "reserved" not in watch_timer(driver, "w2")[1]  # spent: the next poll is paced
