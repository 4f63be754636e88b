"""What a RunPod cancel's receipt says when RunPod refuses the cancel or makes it wait.

Against the RunPod fake in its own process: a ``/cancel`` answered 500 or 401 is no
acknowledgement (evidence stays ``no_evidence``, the job is a leak) and the receipt keeps the
HTTP reason, also when the confirming ``/status`` reads fail as well; a cancel that waited for
the fleet's ``/cancel`` token says how long in its receipt and in the
``gpuhedge_cancel_token_wait_seconds`` histogram.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.receipts import Evidence
from gpuhedge_celery.metrics import record
from tests.support.runpod_fake import KEY, runpod_provider
from tests.test_metrics_record import Delta

pytestmark = pytest.mark.timeout(60)

RUNNING = {"runpod_fake": {"*": {"queue_s": 0.0, "run_s": 60}}}
WAIT = "gpuhedge_cancel_token_wait_seconds"


@pytest.mark.parametrize("code", [500, 401])
@pytest.mark.parametrize("status_fails", [False, True])
def test_a_refused_cancel_keeps_no_evidence_and_its_http_reason(runpod, code, status_fails):
    p = runpod_provider(runpod, cancel_confirm_s=0.3)
    h = p.submit(RUNNING)
    faults = {"cancel": {"errors_next": 100, "error_code": code}}
    if status_fails:  # RunPod down for every route: the confirming reads fail too
        faults["status"] = {"errors_next": 1000, "error_code": 503}
    runpod.configure(faults=faults)
    receipt = p.cancel(h)
    assert receipt.evidence is Evidence.NO_EVIDENCE and receipt.leaked
    assert receipt.cancel_ack_ms is None and not receipt.billing_stop_confirmed
    assert f"HTTP {code}" in receipt.note and KEY not in receipt.note, receipt.note
    assert runpod.job("ep1", h.job_id)["cancelled"] is False


def test_a_cancel_that_waited_for_its_token_says_so_in_the_receipt_and_the_histogram(runpod):
    assert record.active()  # prometheus_client is a test dependency
    runpod.configure(cancel_stop_s=0.05)
    # /cancel 10 per 10 s: a burst of one token, the next 1.25 s later
    limits = {"window_s": 10, "run": 1000, "status": 2000, "cancel": 10, "shared": False}
    p = runpod_provider(runpod, rate_limits=limits, cancel_confirm_s=5)
    first, second = p.submit(RUNNING), p.submit(RUNNING)
    d = Delta()
    at_once, waited = p.cancel(first), p.cancel(second)
    for r in (at_once, waited):
        assert r.evidence is Evidence.CONFIRMED_TERMINAL and not r.leaked
    assert at_once.token_wait_ms is not None and at_once.token_wait_ms < 100
    assert waited.token_wait_ms is not None and waited.token_wait_ms > 800
    assert d.of(f"{WAIT}_count", provider="rp") == 2
    observed_s = d.of(f"{WAIT}_sum", provider="rp")
    in_receipts_s = (at_once.token_wait_ms + waited.token_wait_ms) / 1000  # rounded to 0.1 ms
    assert observed_s == pytest.approx(in_receipts_s, abs=1e-3)
