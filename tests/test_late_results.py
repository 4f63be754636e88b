"""A loser's result after its race finished: priced, settled, in the receipt and the record.

A loser whose cancel was never shown to stop it (the cancel was refused, say) is listed as a
leak and keeps its whole reservation. When its job ends anyway and its result arrives, the job
is over: the finished race takes the result (it changes no winner), the receipt and the record
are rewritten with the job's price, its reservation settles at that price, and nothing is left
for the janitor to cancel.
"""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.core.attempts import Phase
from gpuhedge_celery.core.budget import BudgetCaps
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import AttemptResult, JobHandle, JobState
from gpuhedge_celery.core.ledger import counters_from_ledger, differences
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.race import Race
from gpuhedge_celery.core.race_events import (
    AttemptSubmitted,
    CancelAcknowledged,
    CancelFailed,
    ResultArrived,
)
from gpuhedge_celery.core.receipts import CancelReceipt, Evidence
from gpuhedge_celery.race.attempts import SubmitHow
from gpuhedge_celery.race.base import JobRef
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store.budget import BudgetStore
from tests.test_races_driver import Recorder, build_driver

pytestmark = pytest.mark.timeout(60)

SLOW = {"sim": {"p": {"queue_s": 0, "run_s": 1000}, "h": {"queue_s": 0, "run_s": 1000}}}


def leaked_race(verified_ack: bool = True) -> Race:
    """p and h both running; h wins at 3 s; p's cancel is acknowledged, never confirmed."""
    clock = VirtualClock(100.0)
    race = Race(parse_policy("hedge:p->h@0s"), clock, race_id="r1")
    race.start()
    for a in race.attempts:
        race.handle(AttemptSubmitted(a.id, f"job-{a.id}", {"job_id": f"job-{a.id}"}))
    clock.advance(3.0)
    race.handle(ResultArrived("a2"))
    ack = CancelReceipt("p", "job-a1", evidence=Evidence.PROVIDER_ACK, cancel_ack_ms=103_100.0)
    race.handle(CancelAcknowledged("a1", ack if verified_ack else None))
    race.handle(CancelFailed("a1", "no terminal state within the cancel window"))
    assert race.finished and race.winner == "a2"
    return race


@pytest.mark.parametrize("verified", [True, False])
def test_a_finished_race_takes_a_leaked_losers_late_result_and_keeps_its_winner(verified):
    race = leaked_race()
    p = race.attempt_for("primary")
    assert p.phase is Phase.LEAKED and p.receipt.leaked
    race.clock.advance(4.0)
    assert race.handle(ResultArrived("a1", verified=verified)) == []  # no action, no new winner
    assert race.winner == "a2" and p.phase is Phase.ENDED and p.valid is False
    assert p.result_at == pytest.approx(7.0)  # priced to it either way
    # only a read of the provider proves the end: a delivery nobody checked keeps the evidence
    # and the leak flag (the job may still run, and a forger must not be able to hide it)
    expected = Evidence.CONFIRMED_TERMINAL if verified else Evidence.PROVIDER_ACK
    assert p.receipt.evidence is expected and p.receipt.confirmed_terminal is verified
    assert p.receipt.leaked is not verified
    assert p.receipt.terminal_status is (JobState.COMPLETED if verified else None)
    assert "after the race finished" in p.receipt.note
    # a second delivery of it changes nothing
    before = race.to_dict()
    race.clock.advance(1.0)
    assert race.handle(ResultArrived("a1")) == [] and race.to_dict() == before


def test_a_finished_race_ignores_a_result_of_a_loser_shown_stopped():
    race = leaked_race()
    race.handle(ResultArrived("a1"))
    h = race.attempt_for("hedge")
    before = race.to_dict()
    assert race.handle(ResultArrived(h.id, JobState.FAILED, valid=False)) == []
    assert race.to_dict() == before


def leaked_driver_race(redis_client, prefix, accepted=True):
    """A driver race on Redis with a budget: h wins, p's cancel is accepted (or refused) and
    never confirmed, so p is a finished race's leak. Returns (driver, providers, ledger)."""
    ledger = BudgetStore(redis_client, prefix)
    driver, effects, cfg, _, providers = build_driver(redis_client, prefix, Recorder())
    driver.budget = RaceBudget(ledger, BudgetCaps(ceiling_usd=1000))
    driver.create("r1", SLOW, build_spec(cfg, "hedge:p->h@0s"), submit_first=True)
    for race_id, attempt_id in effects.launched:
        driver.submit_attempt(race_id, attempt_id, SubmitHow(decided_here=True))
    driver.step("r1", ResultArrived("a2"))  # h wins: p is cancelled...
    refused = CancelReceipt("p", "", note="cancel: HTTP 500")  # no evidence: refused
    driver.step("r1", (CancelAcknowledged("a1", None if accepted else refused),
                       CancelFailed("a1", "no terminal state")))  # fmt: skip
    return driver, providers, ledger


def deliver_late(driver, provider, cost_usd):
    state = driver.store.load("r1").state
    handle = JobHandle.from_dict(state["race"]["attempts"][0]["handle"])
    late = AttemptResult("p", handle.job_id, JobState.COMPLETED, 9000.0, {"audio": "x"},
                         metrics={"cost_usd": cost_usd})  # fmt: skip
    driver.conclude(JobRef("r1", "a1", provider.name, handle.to_dict(), 60.0), state["spec"], late)
    return driver.store.receipt("r1")


@pytest.mark.parametrize("verified", [True, False])
def test_the_driver_prices_settles_and_records_a_late_result(redis_client, prefix, verified):
    """Verified (a read of the provider, as RunPod's): the job is shown ended, its leak cleared
    and its job unregistered. Nothing checked (as Cerebrium's): it is priced, but stays a
    listed leak the janitor keeps trying to stop."""
    driver, providers, ledger = leaked_driver_race(redis_client, prefix)
    receipt = driver.store.receipt("r1")
    assert receipt["finished"] and receipt["leaked"]
    # the cancel was accepted: settled at once, at its price to the acknowledgement
    first = int(ledger.reservation("r1", "a1")["settled"]) / 1e9
    assert first == pytest.approx(receipt["attempts"][0]["billed_usd"], abs=1e-9)
    provider = providers["p"]
    provider.delivery_is_verified = verified
    receipt = deliver_late(driver, provider, 0.0123)
    p = receipt["attempts"][0]
    assert receipt["winner"] == "a2" and receipt["leaked"] is not verified
    assert p["usd"] == 0.0123 and p["cost_source"] == "provider"
    assert p["cancel_receipt"]["confirmed_terminal"] is verified
    # the ledger holds the same figure: the reported execution plus the worker's idle window
    rate = driver.store.load("r1").state["spec"]["rates"]["p"]
    settled = int(ledger.reservation("r1", "a1")["settled"]) / 1e9
    assert settled == pytest.approx(p["billed_usd"], abs=1e-9)
    assert p["billed_usd"] == pytest.approx(0.0123 + rate["idle_s"] * rate["rate_per_s"])
    # settled again, once: the difference joins the ledger as an adjustment
    adjusts = [e for _, e in ledger.entries() if e.get("type") == "adjust"]
    assert len(adjusts) == 1 and int(adjusts[0]["nano"]) / 1e9 == pytest.approx(settled - first)
    assert adjusts[0]["source"] == ("late" if verified else "late_estimate")
    assert ledger.reservation("r1", "a1")["late"] == "1"
    assert ledger.settle("r1", [("a1", 1, "late")], 0) == (0, 0)  # once: a repeat is a no-op
    assert int(ledger.reservation("r1", "a1")["settled"]) / 1e9 == pytest.approx(settled)
    # the counters are still what replaying the ledger gives (ledger repair finds nothing)
    totals = {k: v for k, v in ledger.totals().items() if k[:2] in ("r|", "s|", "o|")}
    assert differences(totals, counters_from_ledger(e for _, e in ledger.entries())) == {}
    record = list(driver.store.records.read())[-1][1]  # the corrected record, last
    assert record["attempts"][0]["usd"] == 0.0123 and record["leaked"] is not verified
    # a job shown ended leaves the janitor's list; one nothing checked stays on it
    assert ("a1" in driver.store.live_jobs("r1")) is not verified


def test_a_delivery_nothing_checked_never_lowers_the_ledger(redis_client, prefix):
    """A refused cancel keeps the whole reservation (swept as unproven); a delivery nobody can
    check (a forged one, say) then claims a tiny cost: the ledger keeps the figure, the leak
    stays listed and the job stays on the janitor's list."""
    driver, providers, ledger = leaked_driver_race(redis_client, prefix, accepted=False)
    later = RaceBudget(ledger, BudgetCaps(ceiling_usd=1000), clock=VirtualClock(time.time() + 1e5))
    assert later.sweep(lambda race_id: driver.store.load(race_id).state, grace_ms=0) == 1
    reserved = int(ledger.reservation("r1", "a1")["settled"])
    assert reserved == int(ledger.reservation("r1", "a1")["amount"])
    spent = dict(ledger.totals())
    receipt = deliver_late(driver, providers["p"], 0.000001)  # the sim: nothing checks it
    assert int(ledger.reservation("r1", "a1")["settled"]) == reserved
    assert {k: v for k, v in ledger.totals().items() if k.startswith("s|")} == {
        k: v for k, v in spent.items() if k.startswith("s|")
    }
    assert receipt["leaked"] and "a1" in driver.store.live_jobs("r1")


@pytest.mark.parametrize("accepted", [True, False])
def test_a_leak_settles_at_its_acknowledgement_or_keeps_its_whole_reservation(
    redis_client, prefix, accepted
):
    """An accepted cancel nothing can confirm settles at once, at its price to the
    acknowledgement; a refused one keeps its whole reservation until the janitor's sweep
    (nothing shows the job was even told to stop)."""
    ledger = BudgetStore(redis_client, prefix)
    driver, effects, cfg, _, _ = build_driver(redis_client, prefix, Recorder())
    driver.budget = RaceBudget(ledger, BudgetCaps(ceiling_usd=1000))
    driver.create("r1", SLOW, build_spec(cfg, "hedge:p->h@0s"), submit_first=True)
    for race_id, attempt_id in effects.launched:
        driver.submit_attempt(race_id, attempt_id, SubmitHow(decided_here=True))
    driver.step("r1", ResultArrived("a2"))
    refused = CancelReceipt("p", "", note="cancel: HTTP 500")  # no evidence: refused
    driver.step("r1", (CancelAcknowledged("a1", None if accepted else refused),
                       CancelFailed("a1", "no terminal state")))  # fmt: skip
    reserved = int(ledger.reservation("r1", "a1")["amount"])
    later = RaceBudget(ledger, BudgetCaps(ceiling_usd=1000), clock=VirtualClock(time.time() + 1e5))
    swept = later.sweep(lambda race_id: driver.store.load(race_id).state, grace_ms=0)
    settled = int(ledger.reservation("r1", "a1")["settled"])
    receipt_usd = driver.store.receipt("r1")["attempts"][0]["billed_usd"]
    if accepted:
        assert swept == 0 and ledger.reservation("r1", "a1")["source"] == "estimated"
        assert settled < reserved and settled / 1e9 == pytest.approx(receipt_usd, abs=1e-9)
    else:
        assert swept == 1 and ledger.reservation("r1", "a1")["source"] == "unproven"
        assert settled == reserved and receipt_usd == pytest.approx(reserved / 1e9, abs=1e-9)


def test_a_cap_passing_after_the_finish_is_no_late_result():
    race = leaked_race()
    before = race.to_dict()
    race.clock.advance(30.0)
    assert race.handle(ResultArrived("a1", JobState.TIMEOUT, valid=False)) == []
    assert race.to_dict() == before and race.attempt_for("primary").phase is Phase.LEAKED


def test_a_janitor_confirmed_leak_replaces_its_acknowledgement_price_once(redis_client, prefix):
    """A finished race's leak settled at its cancel's acknowledgement; the janitor's cancel later
    shows the job stopped, with the provider's own figure: that figure replaces the first."""
    ledger = BudgetStore(redis_client, prefix)
    driver, effects, cfg, _, _ = build_driver(redis_client, prefix, Recorder())
    driver.budget = RaceBudget(ledger, BudgetCaps(ceiling_usd=1000))
    driver.create("r1", SLOW, build_spec(cfg, "hedge:p->h@0s"), submit_first=True)
    for race_id, attempt_id in effects.launched:
        driver.submit_attempt(race_id, attempt_id, SubmitHow(decided_here=True))
    driver.step("r1", ResultArrived("a2"))
    driver.step("r1", (CancelAcknowledged("a1", None), CancelFailed("a1", "no terminal state")))
    first = int(ledger.reservation("r1", "a1")["settled"])
    state = driver.store.load("r1").state
    race = Race.from_dict(state["race"], driver.clock)
    p = race.attempt_for("primary")  # what the janitor's confirmed cancel leaves
    p.receipt.reconciled_cost_usd = 0.0042
    p.receipt.confirm_terminal(JobState.CANCELLED, 1.0)
    p.phase = Phase.CANCELLED
    state = {**state, "race": race.to_dict()}
    assert driver.budget.settle_race("r1", race, state) == 0  # settled already: unchanged
    assert int(ledger.reservation("r1", "a1")["settled"]) == first
    driver.budget.settle_race("r1", race, state, resettle={"a1"})
    rate = state["spec"]["rates"]["p"]
    expected = 0.0042 + rate["idle_s"] * rate["rate_per_s"]
    assert int(ledger.reservation("r1", "a1")["settled"]) / 1e9 == pytest.approx(expected)
    driver.budget.settle_race("r1", race, state, resettle={"a1"})  # once only
    assert int(ledger.reservation("r1", "a1")["settled"]) / 1e9 == pytest.approx(expected)
