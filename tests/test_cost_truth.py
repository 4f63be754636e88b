"""One price per job: the rule receipts, records and the ledger's settlements share (pure).

The provider's own figure beats our clock; without one, a job is priced to the moment it is
known to have stopped (its result, else the provider's acknowledgement of its cancel); a job
never shown stopped is priced at its cap, in the receipt as in the ledger.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.attempts import Attempt, Phase
from gpuhedge_celery.core.outcome import attempt_cost
from gpuhedge_celery.core.rates import ProviderRate
from gpuhedge_celery.core.receipts import CancelReceipt, Evidence
from gpuhedge_celery.core.settlement import ESTIMATED, RECONCILED, UNPROVEN, settle_attempt

RATE = ProviderRate(0.001, 5.0)  # $ per s, and a 5 s idle window per started worker
START = 1_000.0  # the race's start on its clock (epoch s)


def loser(*, cancel_at=2.0, ack_at=None, result_at=None, state=None, was_running=None, **kw):
    """A primary submitted at 0.5 s and cancelled at ``cancel_at`` (race-relative s)."""
    receipt = CancelReceipt("rp", "job-1", was_running=was_running, cancel_sent_ms=0)
    if ack_at is not None:
        receipt.cancel_ack_ms = (START + ack_at) * 1000.0
        receipt.upgrade(Evidence.PROVIDER_ACK)
    for name, value in kw.items():
        setattr(receipt, name, value)
    return Attempt(
        "a1",
        "rp",
        "primary",
        0.0,
        phase=Phase.CANCELLED,
        submitted_at=0.5,
        job_id="job-1",
        handle={"job_id": "job-1"},
        cancel_sent_at=cancel_at,
        result_at=result_at,
        result_state=state,
        receipt=receipt,
    )


def cost(a, summary=None, cap_s=60.0):
    return attempt_cost(a, RATE, summary, started_at=START, cap_s=cap_s)


def test_the_providers_figure_wins_over_a_queued_guess_at_cancel_time():
    # decided while it looked queued; RunPod's confirming read says it ran 3.2 s before stopping
    a = loser(was_running=False, reconciled_cost_usd=0.0032)
    found = cost(a)
    assert (found.active_usd, found.started, found.source) == (0.0032, True, "provider")
    assert found.billed_usd == pytest.approx(0.0032 + 0.005)
    settled = settle_attempt(a, RATE, 60.0, 1.0, started_at=START)
    assert (settled.usd, settled.source) == (found.billed_usd, RECONCILED)


def test_a_result_metric_from_the_provider_prices_the_job():
    a = loser(result_at=4.0, state="COMPLETED")
    found = cost(a, {"metrics": {"cost_usd": 0.0021}})
    assert (found.active_usd, found.source) == (0.0021, "provider")


def test_a_cancel_that_waited_for_a_token_is_priced_to_its_acknowledgement():
    # decided at 2 s, reached the provider at 9 s: the job ran (and billed) until then
    a = loser(cancel_at=2.0, ack_at=9.0)
    assert cost(a).active_usd == pytest.approx((9.0 - 0.5) * 0.001)
    without_ack = loser(cancel_at=2.0)
    assert cost(without_ack).active_usd == pytest.approx((2.0 - 0.5) * 0.001)


def test_a_result_after_the_cancel_is_priced_to_the_result():
    # the cancel did not stop it: it ran to its end and delivered at 6 s
    a = loser(cancel_at=2.0, ack_at=2.1, result_at=6.0, state="COMPLETED")
    assert cost(a).active_usd == pytest.approx((6.0 - 0.5) * 0.001)
    settled = settle_attempt(a, RATE, 60.0, 1.0, started_at=START)
    assert settled.source == ESTIMATED and settled.usd == pytest.approx(5.5 * 0.001 + 0.005)


def test_a_job_seen_cancelled_is_priced_to_the_cancel_not_to_the_sighting():
    a = loser(cancel_at=2.0, ack_at=2.2, result_at=7.0, state="CANCELLED")
    assert cost(a).active_usd == pytest.approx((2.2 - 0.5) * 0.001)


def test_a_queued_cancel_without_a_figure_costs_nothing_and_starts_no_worker():
    found = cost(loser(was_running=False, ack_at=2.0))
    assert (found.active_usd, found.started, found.billed_usd) == (0.0, False, 0.0)


def test_a_refused_cancel_is_priced_at_its_cap_in_the_receipt_and_the_ledger():
    a = loser()  # the provider never accepted the cancel (refused, or no answer)
    a.phase = Phase.LEAKED
    found = cost(a, cap_s=60.0)
    assert (found.active_usd, found.source) == (pytest.approx(0.06), "cap")
    reserved = 60.0 * 0.001 + 0.005  # the reservation is the same worst case
    settled = settle_attempt(a, RATE, 60.0, reserved, started_at=START)
    assert settled.source == UNPROVEN and settled.usd == pytest.approx(found.billed_usd)


def test_an_accepted_but_unconfirmed_cancel_is_priced_to_its_acknowledgement():
    a = loser(ack_at=2.4)  # Cerebrium: the cancel accepted, nothing can confirm the stop
    a.phase = Phase.LEAKED
    found = cost(a, cap_s=60.0)
    assert (found.active_usd, found.source) == (pytest.approx((2.4 - 0.5) * 0.001), "clock")
    settled = settle_attempt(a, RATE, 60.0, 1.0, started_at=START)  # once its window passed
    assert settled.source == ESTIMATED and settled.usd == pytest.approx(found.billed_usd)


def test_the_clock_estimate_never_passes_the_cap():
    a = loser(cancel_at=500.0, ack_at=900.0)
    assert cost(a, cap_s=60.0).active_usd == pytest.approx(0.06)


def test_a_job_seen_cancelled_after_a_refused_cancel_is_priced_to_the_sighting():
    a = loser(cancel_at=2.0, result_at=7.0, state="CANCELLED")
    a.timeline.append([2.0, "cancel_refused"])  # the provider refused ours: someone else's stop
    assert cost(a).active_usd == pytest.approx((7.0 - 0.5) * 0.001)
