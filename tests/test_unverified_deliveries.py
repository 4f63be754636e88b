"""A delivery nothing verified (a Cerebrium webhook, forged or real) for a loser we were
cancelling: it ends the attempt for the race, and hides nothing, whether the race still runs or
has finished.

The job's cancel was refused, accepted but never confirmed, or not answered yet. The delivery
may price the job and end the attempt (the race goes on deciding without it), but it proves no
end: the receipt keeps the job listed as a leak, the job stays registered for the janitor (which
treats it as possibly running), and the job's price, in the receipt, the record and the ledger
alike, never falls below what its cancel alone left: a refused (or unanswered) cancel's whole
reservation, an accepted one's price to its acknowledgement. A valid result that wins is not a
loser's: it still wins.
"""

from __future__ import annotations

import base64
import time

import pytest

from gpuhedge_celery.core.attempts import Phase
from gpuhedge_celery.core.budget import BudgetCaps, worst_case_usd
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import AttemptResult, JobHandle, JobState
from gpuhedge_celery.core.ledger import counters_from_ledger, differences
from gpuhedge_celery.core.outcome import race_outcome
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.race import UNVERIFIED_END, Race, may_run
from gpuhedge_celery.core.race_events import (
    AttemptSubmitted,
    Cancel,
    CancelAcknowledged,
    CancelFailed,
    DeclareWinner,
    RaceFinished,
    ResultArrived,
    StatusObserved,
    StopRequested,
    TimerDue,
)
from gpuhedge_celery.core.rates import ProviderRate
from gpuhedge_celery.core.receipts import CancelReceipt, Evidence
from gpuhedge_celery.core.settlement import ESTIMATED, UNPROVEN, settle_attempt
from gpuhedge_celery.core.validators import tone_wav
from gpuhedge_celery.race.attempts import SubmitHow
from gpuhedge_celery.race.base import JobRef
from gpuhedge_celery.race.budget import LATE_ESTIMATE, RaceBudget
from gpuhedge_celery.race.janitor import Janitor, JanitorOptions
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.signing import sign_result
from gpuhedge_celery.store.budget import BudgetStore
from tests.test_late_results import deliver_late, leaked_driver_race
from tests.test_races_driver import Recorder, build_driver

pytestmark = pytest.mark.timeout(60)

RATES = {"p": ProviderRate(0.001, 5.0), "h": ProviderRate(0.001, 5.0)}
CAPS = {"p": 120.0, "h": 120.0}
RESERVED = worst_case_usd(120.0, 0.001, 5.0)
REFUSED = CancelReceipt("p", "", note="cancel: HTTP 500")  # no evidence: the provider refused it


def answer_cancel(race: Race, attempt_id: str, answer: str) -> None:
    """The provider's answer to the attempt's cancel: ``refused``, ``accepted`` (never
    confirmed, as Cerebrium's always is) or ``in_flight`` (none yet)."""
    if answer == "refused":
        race.handle(CancelAcknowledged(attempt_id, REFUSED))
        race.handle(CancelFailed(attempt_id, "the provider refused the cancel or never answered"))
    elif answer == "accepted":
        at_ms = race.clock.now() * 1000.0
        ack = CancelReceipt("p", "", evidence=Evidence.PROVIDER_ACK, cancel_ack_ms=at_ms)
        race.handle(CancelAcknowledged(attempt_id, ack))
        race.handle(CancelFailed(attempt_id, "no terminal state within the cancel window"))


def cutover_race(answer: str) -> Race:
    """p cut over while queued, its cancel answered as ``answer``; h running: the race runs."""
    clock = VirtualClock(100.0)
    race = Race(parse_policy("cutover:p->h"), clock, race_id="r1")
    race.start()
    race.handle(AttemptSubmitted("a1", "job-a1", {"job_id": "job-a1"}))
    clock.advance(2.5)
    race.handle(TimerDue("cutover"))
    assert race.handle(StatusObserved("a1", JobState.QUEUED))[0] == Cancel(
        "a1", "cutover: still queued"
    )
    race.handle(AttemptSubmitted("a2", "job-a2", {"job_id": "job-a2"}))
    clock.advance(0.5)
    answer_cancel(race, "a1", answer)
    assert not race.finished and race.winner is None
    return race


def priced(race: Race, attempt_id: str) -> tuple[dict, object]:
    """The attempt's summary as the receipt prices it, and its settlement: one figure."""
    i = next(i for i, a in enumerate(race.attempts) if a.id == attempt_id)
    summary = race_outcome(race, RATES, {}, CAPS).attempts[i]
    a = race.attempts[i]
    found = settle_attempt(a, RATES[a.provider], CAPS[a.provider], RESERVED, started_at=100.0)
    assert summary["billed_usd"] == pytest.approx(found.usd)
    return summary, found


@pytest.mark.parametrize("answer", ["refused", "accepted", "in_flight"])
@pytest.mark.parametrize("state", [JobState.FAILED, JobState.COMPLETED])
def test_a_delivery_nothing_verified_ends_the_loser_and_hides_nothing(answer, state):
    race = cutover_race(answer)
    p = race.attempt_for("primary")
    evidence = p.receipt.evidence
    before = priced(race, "a1")[1] if answer == "accepted" else None
    race.clock.advance(2.0)
    # a forged FAILED, or a COMPLETED whose payload is no valid result: it cannot win
    out = race.handle(ResultArrived("a1", state, False, ("forged",), verified=False))
    assert not any(isinstance(x, DeclareWinner) for x in out)
    assert not race.finished and race.attempt_for("hedge").phase is Phase.RUNNING
    # over for the race's decisions (its slot is free) ...
    assert p.phase is Phase.ENDED and p.result_state == state.value and race.live_count == 1
    # ... but not shown stopped: still a listed leak, its job possibly running
    assert p.receipt.leaked and not p.receipt.confirmed_terminal
    assert p.receipt.evidence is evidence and p.receipt.terminal_status is None
    assert UNVERIFIED_END in p.reasons and "not verified" in p.receipt.note
    assert may_run(p) and "leaked" in race.flags
    summary, settled = priced(race, "a1")
    if answer == "accepted":  # priced to the delivery: never below its acknowledgement's price
        assert settled.source == ESTIMATED and settled.usd >= before.usd
        assert summary["cost_source"] == "clock"
        assert summary["usd"] == pytest.approx((p.result_at - p.submitted_at) * 0.001)
    else:  # nothing shows it was even told to stop: its whole reservation, as before
        assert settled.source == UNPROVEN and settled.usd == pytest.approx(RESERVED)
        assert summary["cost_source"] == "cap"
    # the hedge wins; the race finishes with the primary still listed as a leak
    race.clock.advance(1.0)
    assert race.handle(ResultArrived("a2"))[-1] == RaceFinished("a2", "")
    assert p.receipt.leaked and may_run(p)
    assert priced(race, "a1")[1] == settled


@pytest.mark.parametrize("answer", ["refused", "accepted"])
def test_the_running_race_prices_it_as_the_finished_race_does(answer):
    """The same delivery before and after the race finished: the same receipt and price."""
    live = cutover_race(answer)
    live.clock.advance(2.0)
    live.handle(ResultArrived("a1", JobState.FAILED, False, ("forged",), verified=False))
    live.handle(ResultArrived("a2"))
    finished = cutover_race(answer)
    finished.clock.advance(1.0)
    finished.handle(ResultArrived("a2"))
    assert finished.finished and finished.attempt_for("primary").phase is Phase.LEAKED
    finished.clock.advance(1.0)
    finished.handle(ResultArrived("a1", JobState.FAILED, False, ("forged",), verified=False))
    ours, theirs = live.attempt_for("primary"), finished.attempt_for("primary")
    assert ours.receipt.leaked and theirs.receipt.leaked and may_run(theirs)
    assert ours.receipt.evidence is theirs.receipt.evidence
    assert (ours.result_at, ours.result_state) == (theirs.result_at, theirs.result_state)
    assert priced(live, "a1")[1] == priced(finished, "a1")[1]


def test_a_valid_result_nothing_verified_still_wins():
    """A Cerebrium result can win (signed, it is as good as its key): its cancel was refused,
    but it ran to a valid result, which the caller gets; the hedge is cancelled."""
    race = cutover_race("refused")
    race.clock.advance(1.0)
    out = race.handle(ResultArrived("a1", verified=False))
    assert out[:2] == [DeclareWinner("a1"), Cancel("a2", "lost")]
    p = race.attempt_for("primary")
    assert race.winner == "a1" and UNVERIFIED_END not in p.reasons and not p.receipt.leaked


def test_a_valid_loser_delivered_while_its_cancel_is_in_flight_proves_nothing():
    """h won; p's cancel is in flight when a delivery nobody checked brings a valid result. It
    cannot win: p ends unproven, and the cancel's answer, arriving after, changes nothing."""
    clock = VirtualClock(100.0)
    race = Race(parse_policy("hedge:p->h@0s"), clock, race_id="r1")
    race.start()
    for a in race.attempts:
        race.handle(AttemptSubmitted(a.id, f"job-{a.id}", {"job_id": f"job-{a.id}"}))
    clock.advance(3.0)
    assert race.handle(ResultArrived("a2")) == [DeclareWinner("a2"), Cancel("a1", "lost")]
    clock.advance(0.1)
    assert race.handle(ResultArrived("a1", verified=False)) == [RaceFinished("a2", "")]
    p = race.attempt_for("primary")
    assert race.winner == "a2" and p.phase is Phase.ENDED and p.valid is True
    assert p.receipt.leaked and p.receipt.evidence is Evidence.NO_EVIDENCE and may_run(p)
    summary, settled = priced(race, "a1")
    assert settled.source == UNPROVEN and summary["cost_source"] == "cap"
    before = race.to_dict()
    answer_cancel(race, "a1", "accepted")  # the answer the cancel in flight brings back
    assert race.to_dict() == before


# ---------------------------------------------------------------------- on Redis, with a budget
def cutover_driver_race(redis_client, prefix, answer: str):
    """A driver race on Redis with a budget: p cut over while queued, its cancel answered as
    ``answer``, h running. Returns (driver, providers, ledger)."""
    ledger = BudgetStore(redis_client, prefix)
    driver, effects, cfg, _, providers = build_driver(redis_client, prefix, Recorder())
    driver.budget = RaceBudget(ledger, BudgetCaps(ceiling_usd=1000))
    request = {"sim": {"p": {"queue_s": 10_000, "run_s": 1000}, "h": {"queue_s": 0, "run_s": 1000}}}
    spec = build_spec(cfg, "cutover:p->h@q0.05s+s100s")
    driver.create("r1", request, spec, submit_first=True)
    time.sleep(0.1)
    driver.step("r1", TimerDue("cutover"))  # polled: still queued, cut over
    assert effects.cancelled == [("r1", "a1")] and effects.launched == [("r1", "a2")]
    driver.submit_attempt("r1", "a2", SubmitHow(decided_here=True))
    if answer != "in_flight":  # accepted: acknowledged (no receipt of its own), unconfirmed
        driver.step("r1", (CancelAcknowledged("a1", REFUSED if answer == "refused" else None),
                           CancelFailed("a1", "no terminal state")))  # fmt: skip
    race = Race.from_dict(driver.store.load("r1").state["race"], driver.clock)
    assert not race.finished and race.attempt_for("hedge").phase is Phase.RUNNING
    for provider in providers.values():
        provider.delivery_is_verified = False  # as Cerebrium's: nothing can check a delivery
    return driver, providers, ledger


def deliver(driver, providers, state: JobState) -> None:
    """A delivery for p, as a webhook brings it (a forged one looks the same)."""
    saved = driver.store.load("r1").state
    handle = JobHandle.from_dict(saved["race"]["attempts"][0]["handle"])
    forged = AttemptResult(
        "p", handle.job_id, state, 10.0, {"audio": "forged"} if state.terminal else None,
        metrics={"cost_usd": 0.000001}, error=None if state is JobState.COMPLETED else "forged",
    )  # fmt: skip
    ref = JobRef("r1", "a1", "p", handle.to_dict(), 60.0)
    driver.conclude(ref, saved["spec"], forged)


def agree_on_a1(driver, ledger) -> float:
    """Receipt, record and ledger hold one price for p; the counters replay from the ledger."""
    receipt = driver.store.receipt("r1")
    record = list(driver.store.records.read())[-1][1]
    settled = int(ledger.reservation("r1", "a1")["settled"]) / 1e9
    assert receipt["attempts"][0]["billed_usd"] == pytest.approx(settled, abs=1e-9)
    assert record["attempts"][0]["billed_usd"] == pytest.approx(settled, abs=1e-6)
    totals = {k: v for k, v in ledger.totals().items() if k[:2] in ("r|", "s|", "o|")}
    assert differences(totals, counters_from_ledger(e for _, e in ledger.entries())) == {}
    return settled


@pytest.mark.parametrize("answer", ["refused", "accepted", "in_flight"])
@pytest.mark.parametrize("state", [JobState.FAILED, JobState.COMPLETED])
def test_the_driver_keeps_the_leak_the_job_and_the_reservation(redis_client, prefix, answer, state):
    driver, providers, ledger = cutover_driver_race(redis_client, prefix, answer)
    amount = int(ledger.reservation("r1", "a1")["amount"])
    first = ledger.reservation("r1", "a1").get("settled")  # an accepted cancel: settled at once
    assert (first is not None) is (answer == "accepted")
    deliver(driver, providers, state)  # a forged FAILED, or a COMPLETED that is not valid
    saved = driver.store.load("r1")
    race = Race.from_dict(saved.state["race"], driver.clock)
    p = race.attempt_for("primary")
    assert not race.finished and p.phase is Phase.ENDED and UNVERIFIED_END in p.reasons
    assert saved.state["results"]["a1"]["valid"] is False
    assert p.receipt.leaked and "a1" in driver.store.live_jobs("r1")
    reservation = ledger.reservation("r1", "a1")
    if answer == "accepted":  # only ever up from its acknowledgement's price
        assert int(reservation["settled"]) >= int(first)
    else:  # the whole reservation, kept as spent: nothing shows the job was told to stop
        assert int(reservation["settled"]) == amount and reservation["source"] == UNPROVEN
    # h wins: the race finishes; p is still a listed leak with its job registered
    driver.step("r1", ResultArrived("a2"))
    receipt = driver.store.receipt("r1")
    assert receipt["winner"] == "a2" and receipt["leaked"]
    assert [leak["attempt"] for leak in receipt["leaks"]] == ["a1"]
    assert list(driver.store.live_jobs("r1")) == ["a1"]
    settled = agree_on_a1(driver, ledger)
    if answer != "accepted":
        assert settled == pytest.approx(amount / 1e9, abs=1e-9)
    assert ledger.open_count() == 0


@pytest.mark.parametrize("answer", ["refused", "accepted"])
def test_the_janitor_cancels_the_job_a_delivery_nothing_verified_ended(
    redis_client, prefix, answer
):
    """The race is over, nobody advances it: the janitor still takes p's job as possibly
    running, cancels it, and unregisters it only once that cancel shows it stopped. The
    receipt, record and ledger still agree on p's price, which did not fall."""
    driver, providers, ledger = cutover_driver_race(redis_client, prefix, answer)
    deliver(driver, providers, JobState.FAILED)
    driver.step("r1", ResultArrived("a2"))
    before = agree_on_a1(driver, ledger)
    options = JanitorOptions(stale_ms=1, coordinators_alive=lambda: False, budget=driver.budget)
    janitor = Janitor(driver.store, driver.timers, providers.__getitem__, Recorder(), options)
    time.sleep(0.01)  # stale
    cleanup = janitor.clean("r1")
    assert (cleanup.action, cleanup.cancelled, cleanup.leaked) == ("finalised", ["a1"], [])
    assert driver.store.live_jobs("r1") == {}
    p = driver.store.receipt("r1")["attempts"][0]
    assert p["cancel_receipt"]["confirmed_terminal"] and not p["cancel_receipt"]["leaked"]
    assert p["timeline"][-1][1] == "cancelled by the janitor"
    assert agree_on_a1(driver, ledger) >= before


def test_the_janitor_ending_a_running_race_keeps_such_a_jobs_price(redis_client, prefix):
    """A stopped race's coordinator dies with h's cancel unanswered, after a delivery nobody
    checked ended p (its cancel accepted: settled at its acknowledgement, then again to the
    delivery). The janitor ends the race and its cancel shows p stopped: p is no leak any
    more, and keeps the price the delivery left, on which receipt, record and ledger agree."""
    ledger = BudgetStore(redis_client, prefix)
    driver, effects, cfg, _, providers = build_driver(redis_client, prefix, Recorder())
    driver.budget = RaceBudget(ledger, BudgetCaps(ceiling_usd=1000))
    slow = {"sim": {"p": {"queue_s": 0, "run_s": 1000}, "h": {"queue_s": 0, "run_s": 1000}}}
    driver.create("r1", slow, build_spec(cfg, "hedge:p->h@0s"), submit_first=True)
    for race_id, attempt_id in effects.launched:
        driver.submit_attempt(race_id, attempt_id, SubmitHow(decided_here=True))
    driver.step("r1", StopRequested(by="test"))  # both cancelled
    driver.step("r1", (CancelAcknowledged("a1", None), CancelFailed("a1", "no terminal state")))
    providers["p"].delivery_is_verified = False
    deliver(driver, providers, JobState.FAILED)
    delivered = int(ledger.reservation("r1", "a1")["settled"])
    assert driver.store.receipt("r1") is None and "a1" in driver.store.live_jobs("r1")
    time.sleep(0.3)  # p's job runs on: the janitor's cancel comes later
    options = JanitorOptions(stale_ms=1, coordinators_alive=lambda: False, budget=driver.budget)
    janitor = Janitor(driver.store, driver.timers, providers.__getitem__, Recorder(), options)
    cleanup = janitor.clean("r1")
    assert cleanup.action == "ended" and sorted(cleanup.cancelled) == ["a1", "a2"]
    receipt = driver.store.receipt("r1")
    assert receipt["leaks"] == [] and driver.store.live_jobs("r1") == {}
    assert agree_on_a1(driver, ledger) * 1e9 == pytest.approx(delivered, abs=1)
    assert ledger.open_count() == 0


def test_a_late_delivery_nothing_verified_keeps_a_refused_cancels_reservation(redis_client, prefix):
    """The finished race's rule, before the janitor's sweep settled the refused cancel: a
    delivery nobody can check, claiming a tiny cost, settles the whole reservation as
    unproven; the receipt and record price the job the same."""
    driver, providers, ledger = leaked_driver_race(redis_client, prefix, accepted=False)
    assert ledger.reservation("r1", "a1").get("settled") is None  # open: not swept yet
    receipt = deliver_late(driver, providers["p"], 0.000001)
    reservation = ledger.reservation("r1", "a1")
    assert int(reservation["settled"]) == int(reservation["amount"])
    assert reservation["source"] == UNPROVEN
    assert receipt["leaked"] and "a1" in driver.store.live_jobs("r1")
    assert receipt["attempts"][0]["cost_source"] == "cap"
    agree_on_a1(driver, ledger)


# ------------------------------------------------------- a signed result proves the run ended
SIGNING_KEY = "unverified-deliveries-result-key-0123"


def signed_spec(driver, monkeypatch, *, from_config: bool = True) -> dict:
    """The race's stored spec with its validator swapped for ``hmac`` on the workers' key, as
    a fleet configured with it builds it (``from_config`` False: as a message naming hmac
    itself would, over a config that does not)."""
    monkeypatch.setenv("GPUHEDGE_TEST_RESULT_KEY", SIGNING_KEY)
    spec = {
        **driver.store.load("r1").state["spec"],
        "validator": "hmac",
        "validator_options": {
            "key": "${GPUHEDGE_TEST_RESULT_KEY}",
            "then": "wav",  # the content's check: the signature alone shows the end
            "at": "audio_base64",
        },
    }
    if from_config:
        spec["signature_proves_end"] = True
    return spec


def deliver_output(driver, spec, attempt: str, output) -> None:
    saved = driver.store.load("r1").state
    i = [a["id"] for a in saved["race"]["attempts"]].index(attempt)
    handle = JobHandle.from_dict(saved["race"]["attempts"][i]["handle"])
    provider = handle.provider if hasattr(handle, "provider") else ("p" if i == 0 else "h")
    result = AttemptResult(provider, handle.job_id, JobState.COMPLETED, 10.0, output)
    driver.conclude(JobRef("r1", attempt, provider, handle.to_dict(), 60.0), spec, result)


NOT_A_WAV = {"audio_base64": "bm90IGEgd2F2"}  # signed, but no valid result: it cannot win
A_WAV = {"audio_base64": base64.b64encode(tone_wav(1.0)).decode("ascii")}


def deliver_signed(driver, monkeypatch, key: str, *, from_config: bool = True) -> None:
    """A COMPLETED delivery for p whose output is signed with ``key`` (a loser's: invalid)."""
    spec = signed_spec(driver, monkeypatch, from_config=from_config)
    deliver_output(driver, spec, "a1", sign_result(NOT_A_WAV, key))


def test_a_delivery_signed_by_the_function_shows_the_loser_stopped(
    redis_client, prefix, monkeypatch
):
    """The cancel was refused, but p's output arrives signed with the workers' key: the user's
    function returned, so the run ended. Its receipt is confirmed, its job unregistered, and
    it is priced to the delivery on our clock (not kept at its whole reservation)."""
    driver, providers, ledger = cutover_driver_race(redis_client, prefix, "refused")
    amount = int(ledger.reservation("r1", "a1")["amount"])
    deliver_signed(driver, monkeypatch, SIGNING_KEY)
    race = Race.from_dict(driver.store.load("r1").state["race"], driver.clock)
    p = race.attempt_for("primary")
    assert p.phase is Phase.ENDED and UNVERIFIED_END not in p.reasons and not may_run(p)
    assert p.receipt.confirmed_terminal and not p.receipt.leaked
    reservation = ledger.reservation("r1", "a1")
    assert reservation["source"] in (ESTIMATED, LATE_ESTIMATE)  # our clock: not unproven
    assert int(reservation["settled"]) < amount
    driver.step("r1", ResultArrived("a2"))
    assert driver.store.receipt("r1")["leaks"] == []
    assert "a1" not in driver.store.live_jobs("r1")  # nothing left for the janitor
    agree_on_a1(driver, ledger)


def test_a_delivery_signed_with_another_key_proves_nothing(redis_client, prefix, monkeypatch):
    driver, providers, ledger = cutover_driver_race(redis_client, prefix, "refused")
    amount = int(ledger.reservation("r1", "a1")["amount"])
    deliver_signed(driver, monkeypatch, "a-forgers-own-key-0123456789abcdef")
    race = Race.from_dict(driver.store.load("r1").state["race"], driver.clock)
    p = race.attempt_for("primary")
    assert UNVERIFIED_END in p.reasons and p.receipt.leaked and may_run(p)
    assert int(ledger.reservation("r1", "a1")["settled"]) == amount


def test_a_key_a_message_chose_proves_nothing(redis_client, prefix, monkeypatch):
    """A message may name hmac itself when the config does not: its key (any worker variable)
    is not the fleet's, so a payload signed with it shows no run's end."""
    driver, providers, ledger = cutover_driver_race(redis_client, prefix, "refused")
    amount = int(ledger.reservation("r1", "a1")["amount"])
    deliver_signed(driver, monkeypatch, SIGNING_KEY, from_config=False)
    p = Race.from_dict(driver.store.load("r1").state["race"], driver.clock).attempt_for("primary")
    assert UNVERIFIED_END in p.reasons and p.receipt.leaked and may_run(p)
    assert int(ledger.reservation("r1", "a1")["settled"]) == amount


def test_the_winners_signed_output_replayed_to_a_loser_proves_nothing(
    redis_client, prefix, monkeypatch
):
    """h wins with its signed output; the same payload posted to p's URL (its cancel refused)
    is a copy of h's stored result, not p's end: p keeps its leak and its whole reservation."""
    driver, providers, ledger = cutover_driver_race(redis_client, prefix, "refused")
    amount = int(ledger.reservation("r1", "a1")["amount"])
    spec = signed_spec(driver, monkeypatch)
    output = sign_result(A_WAV, SIGNING_KEY)
    deliver_output(driver, spec, "a2", output)
    saved = driver.store.load("r1").state
    assert Race.from_dict(saved["race"], driver.clock).winner == "a2"
    deliver_output(driver, spec, "a1", output)
    p = Race.from_dict(driver.store.load("r1").state["race"], driver.clock).attempt_for("primary")
    assert UNVERIFIED_END in p.reasons and p.receipt.leaked and may_run(p)
    assert int(ledger.reservation("r1", "a1")["settled"]) == amount
