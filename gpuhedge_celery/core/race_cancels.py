"""The race engine's cancel rules: how a loser's cancel is sent, acknowledged, confirmed or
leaked, and the receipt of an attempt that needed no cancel.

Mixed into :class:`~gpuhedge_celery.core.race.Race` (it uses the race's clock helpers, its
output list and its flags). A cancel asked for before the provider gave a job id is held on the
attempt and sent once the id is known; an acknowledgement upgrades the receipt's evidence; a
terminal state confirms it; a failed cancel leaks the job (it may still be burning a GPU, so it
stays live and the race's ``leaked`` flag is set).
"""

from __future__ import annotations

from typing import Any

from .attempts import Attempt, Phase
from .jobs import JobState
from .race_events import Cancel, CancelAcknowledged, CancelConfirmed, CancelFailed
from .receipts import SUBMIT_OUTCOME_UNKNOWN, CancelReceipt, CancelScope, Evidence


class CancelRules:
    """Cancel handling of the race engine; needs the attributes and helpers of ``Race``."""

    _out: list[Any]

    def _rel(self) -> float:
        raise NotImplementedError

    def _ms(self) -> float:
        raise NotImplementedError

    def flag(self, name: str) -> None:
        raise NotImplementedError

    def _on_cancel_ack(self, a: Attempt, event: CancelAcknowledged) -> None:
        r = a.receipt
        if r is None or a.phase not in (Phase.CANCELLING, Phase.LEAKED):
            return
        p = event.receipt
        # only a provider's answer moves evidence up: a cancel it refused (HTTP 401, 500) or
        # never answered comes back with no evidence, and keeps it
        acked = p is None or p.evidence.rank > Evidence.NO_EVIDENCE.rank
        if acked:
            r.upgrade(Evidence.PROVIDER_ACK)
            r.cancel_ack_ms = self._ms()
        a.timeline.append([self._rel(), "cancel_acknowledged" if acked else "cancel_refused"])
        if p is None:
            return
        if acked and p.cancel_ack_ms is not None:
            r.cancel_ack_ms = p.cancel_ack_ms
        if p.was_running is not None:
            r.was_running = p.was_running
        if p.scope is not CancelScope.UNKNOWN:
            r.scope = p.scope
        for name in (
            "execution_ms_before_cancel",
            "estimated_cost_usd",
            "reconciled_cost_usd",
            "token_wait_ms",
        ):
            if getattr(p, name) is not None:
                setattr(r, name, getattr(p, name))
        r.billing_stop_confirmed = r.billing_stop_confirmed or p.billing_stop_confirmed
        if p.note:
            r.note = p.note
        r.upgrade(p.evidence if p.evidence is not Evidence.CONFIRMED_TERMINAL else r.evidence)
        if p.confirmed_terminal and p.terminal_status is not None:
            # The adapter itself polled the job to a terminal state before returning.
            self._confirm_cancel(a, p.terminal_status, p.terminal_ms)

    def _on_cancel_confirmed(self, a: Attempt, event: CancelConfirmed) -> None:
        if a.phase in (Phase.CANCELLING, Phase.LEAKED):
            self._confirm_cancel(a, event.state)

    def _on_cancel_failed(self, a: Attempt, event: CancelFailed) -> None:
        if a.phase is not Phase.CANCELLING or a.receipt is None:
            return
        a.phase = Phase.LEAKED
        a.receipt.leaked = True
        why = f"cancel failed: {event.error}" if event.error else "cancel failed"
        prior = a.receipt.note  # the adapter's own account (an HTTP reason) stays first
        a.receipt.note = f"{prior}; {why}" if prior and event.error not in prior else why
        a.timeline.append([self._rel(), "leaked"])
        self.flag("leaked")

    def _send_cancel(self, a: Attempt, reason: str) -> None:
        if a.phase is Phase.LAUNCHING:
            a.cancel_requested = True  # cancelled as soon as the provider gives us a job id
            a.cancel_reason = reason
            return
        if a.phase is not Phase.RUNNING:
            return
        a.phase = Phase.CANCELLING
        a.cancel_reason = reason
        a.cancel_sent_at = self._rel()
        was_running = {"QUEUED": False, "IN_PROGRESS": True}.get(a.last_state or "")
        a.receipt = CancelReceipt(
            provider=a.provider,
            job_id=a.job_id,
            was_running=was_running,
            cancel_sent_ms=self._ms(),
            scope=CancelScope.QUEUED_JOB if was_running is False else CancelScope.UNKNOWN,
            note=reason,
        )
        a.timeline.append([a.cancel_sent_at, f"cancel_sent ({reason})"])
        self._out.append(Cancel(a.id, reason))

    def _confirm_cancel(self, a: Attempt, state: JobState, at_ms: float | None = None) -> None:
        assert a.receipt is not None
        a.receipt.confirm_terminal(state, self._ms() if at_ms is None else at_ms)
        a.phase = Phase.CANCELLED
        a.last_state = state.value
        a.timeline.append([self._rel(), f"{state} (cancel confirmed)"])


def unknown_submit_receipt(a: Attempt) -> CancelReceipt | None:
    """The receipt of an attempt whose submit may have started a job we have no id for (its
    reasons say ``submit outcome unknown``): leaked, since nothing can show or stop it."""
    if a.submitted_at is not None or not any(SUBMIT_OUTCOME_UNKNOWN in r for r in a.reasons):
        return None
    receipt = CancelReceipt(provider=a.provider, job_id=a.job_id)
    receipt.note = (
        "; ".join(a.reasons) + " - the provider may run (and bill) a job whose id we never "
        "learnt: no cancel is possible, check the provider's console"
    )
    return receipt  # no evidence, leaked


def not_sent_receipt(a: Attempt) -> CancelReceipt:
    """The receipt of an attempt never sent to its provider (the budget refused it, say): no
    job, so no cancel, no evidence to weigh, no terminal state to confirm, no cost, no leak."""
    return CancelReceipt(
        provider=a.provider,
        job_id="",
        was_running=False,
        estimated_cost_usd=0.0,
        leaked=False,
        note="not sent: " + ("; ".join(a.reasons) or "never submitted"),
    )


def ended_on_its_own(a: Attempt, now_ms: float) -> CancelReceipt:
    """The receipt of a loser that needed no cancel: it ended (or never started) by itself."""
    if a.unsent:
        return not_sent_receipt(a)
    unknown = unknown_submit_receipt(a)
    if unknown is not None:
        return unknown
    receipt = CancelReceipt(provider=a.provider, job_id=a.job_id)
    state = JobState(a.result_state) if a.result_state else JobState.FAILED
    receipt.confirm_terminal(state, now_ms)
    receipt.was_running = a.submitted_at is not None
    if a.submitted_at is None:
        receipt.note = "never submitted: " + "; ".join(a.reasons)
    else:
        receipt.note = f"ended on its own ({state}); no cancel needed"
    return receipt
