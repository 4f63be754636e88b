"""What an http or Modal cancel's receipt says when the provider refuses the cancel.

Against the loopback fakes (tests/support/http_provider_server.py, tests/support/modal_fake.py):
a cancel answered 500/503 or 401 is no acknowledgement (evidence stays ``no_evidence``, the job
is a leak) and the receipt keeps the refusal's reason, also when every confirming status read
or poll fails as well and their notes outnumber it.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.receipts import Evidence
from tests.support.http_provider_server import HttpProviderServer
from tests.support.modal_fake import FakeModalServer
from tests.test_http import KEY, make
from tests.test_modal_provider import build, calls

pytestmark = pytest.mark.timeout(60)


def refusal(note: str) -> str:
    """The receipt note's part that says why the cancel call failed ("" when none does)."""
    return next((part for part in note.split("; ") if part.startswith("cancel call failed")), "")


@pytest.mark.parametrize("code", [500, 401])
@pytest.mark.parametrize("status_fails", [False, True])
def test_a_refused_http_cancel_keeps_no_evidence_and_its_http_reason(code, status_fails):
    with HttpProviderServer() as server:
        server.knobs.api_key = KEY
        server.knobs.queue_s, server.knobs.run_s = 0.0, 60
        p = make(server, cancel_confirm_s=0.3)
        h = p.submit({})
        server.knobs.cancel_errors, server.knobs.cancel_error_status = 100, code
        if status_fails:  # the provider down for every route: the confirming reads fail too
            server.knobs.status_errors, server.knobs.error_status = 1000, 503
        receipt = p.cancel(h)
        assert receipt.evidence is Evidence.NO_EVIDENCE and receipt.leaked
        assert receipt.cancel_ack_ms is None and not receipt.billing_stop_confirmed
        assert f"HTTP {code}" in refusal(receipt.note), receipt.note
        assert KEY not in receipt.note
        if status_fails:  # more failed reads than the note keeps: the refusal still leads
            assert len(server.ops("status")) > 3 and "confirming status failed" in receipt.note
        assert server.truth()[h.job_id]["cancel_refusals"] >= 1


@pytest.mark.parametrize("error", ["InternalError", "AuthError"])
@pytest.mark.parametrize("poll_fails", [False, True])
def test_a_refused_modal_cancel_keeps_no_evidence_and_its_reason(error, poll_fails):
    with FakeModalServer() as server:
        p = build(server, cancel_confirm_s=0.3)
        h = p.submit({"modal_fake": {"run_s": 30}})
        server.knobs.cancel_errors, server.knobs.cancel_error = 100, error
        if poll_fails:  # Modal down for every call: the confirming polls fail too
            server.knobs.poll_errors = 1000
        receipt = p.cancel(h)
        assert receipt.evidence is Evidence.NO_EVIDENCE and receipt.leaked
        assert receipt.cancel_ack_ms is None and not receipt.billing_stop_confirmed
        assert error in refusal(receipt.note), receipt.note
        if poll_fails:  # more failed polls than the note keeps: the refusal still leads
            assert server.control()["counts"]["poll"] > 3
            assert "confirming poll failed" in receipt.note
        assert not calls(server)[h.job_id]["cancelled"]
