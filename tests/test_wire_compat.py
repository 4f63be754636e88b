"""Race state and events stay readable across one release during a rolling upgrade.

A field added to a receipt or an event is left out while it holds its default (a worker of
the previous release reads the rest as before), and a reader ignores fields it does not know
(a worker of this release reads a newer one's state).
"""

from __future__ import annotations

from gpuhedge_celery.core.race_events import ResultArrived, event_from_dict
from gpuhedge_celery.core.receipts import CancelReceipt

PREVIOUS_RECEIPT_FIELDS = {
    "provider", "job_id", "was_running", "cancel_sent_ms", "cancel_ack_ms", "terminal_ms",
    "terminal_status", "execution_ms_before_cancel", "estimated_cost_usd",
    "reconciled_cost_usd", "evidence", "scope", "confirmed_terminal",
    "billing_stop_confirmed", "leaked", "note",
}  # fmt: skip


def test_a_receipt_without_a_token_wait_has_only_the_previous_fields():
    assert set(CancelReceipt("p", "j").to_dict()) == PREVIOUS_RECEIPT_FIELDS
    waited = CancelReceipt("p", "j", token_wait_ms=12.5).to_dict()
    assert waited["token_wait_ms"] == 12.5 and CancelReceipt.from_dict(waited) == CancelReceipt(
        "p", "j", token_wait_ms=12.5
    )


def test_a_reader_ignores_fields_it_does_not_know():
    data = {**CancelReceipt("p", "j").to_dict(), "from_a_later_release": 1}
    assert CancelReceipt.from_dict(data) == CancelReceipt("p", "j")
    event = {**ResultArrived("a1").to_dict(), "from_a_later_release": 1}
    assert event_from_dict(event) == ResultArrived("a1")


def test_a_verified_result_is_written_as_before_and_an_unverified_one_says_so():
    assert "verified" not in ResultArrived("a1").to_dict()
    unverified = ResultArrived("a1", verified=False).to_dict()
    assert unverified["verified"] is False and event_from_dict(unverified).verified is False
