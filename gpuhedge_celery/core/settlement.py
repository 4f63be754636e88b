"""What an ended attempt cost, for settling its budget reservation (pure).

Three sources, best first:

* ``reconciled``: the provider reported the job's billed execution (a result's ``cost_usd`` /
  ``execution_ms`` metric, or a cancel receipt's ``reconciled_cost_usd``), plus the idle window
  of the worker it started;
* ``estimated``: our own clock, the accounting rule of :mod:`.outcome` (submit to result or to
  the cancel, nothing for a job cancelled while queued), capped at the attempt's cap;
* ``unproven``: nothing shows the job stopped or even told to stop (its cancel was refused or
  never answered, or its submit's outcome is unknown): the whole reservation is kept as spent.
  Unknowns count against us. A cancel the provider accepted but cannot confirm settles as
  estimated, to the acknowledgement: at once, in the step that leaked it (``race/budget.py``),
  else at the janitor's sweep.
  A result nothing verified (a Cerebrium webhook, forged or not) that ends such a job, with the
  race running or finished, proves no end: it settles a refused cancel's job as ``unproven``
  still, and an accepted one's again only upwards (``late_estimate``), never lower.

An attempt that was never submitted costs nothing (``not_submitted``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .attempts import Attempt, Phase
from .jobs import JobState
from .outcome import REPORTED, attempt_cost, reported_active_usd, unaccepted
from .race import unverified_end
from .rates import ProviderRate

RECONCILED, ESTIMATED, UNPROVEN = "reconciled", "estimated", "unproven"
NOT_SUBMITTED = "not_submitted"


@dataclass(frozen=True)
class Settlement:
    """An attempt's cost as settled: USD, where the figure comes from, and a short note."""

    usd: float
    source: str
    note: str = ""


def ready_to_settle(a: Attempt, summary: Mapping[str, Any] | None = None) -> bool:
    """Whether the attempt can no longer cost more: ended, and if it ended at its cap (the job
    may still run), its job shown stopped. A leaked attempt is live: it stays reserved."""
    if a.live:
        return False
    if a.result_state != JobState.TIMEOUT.value or not a.handle:
        return True
    cap_cancel = (summary or {}).get("cap_cancel") or {}
    return bool(cap_cancel.get("confirmed_terminal")) or bool(
        a.receipt is not None and a.receipt.confirmed_terminal
    )


def settle_attempt(
    a: Attempt,
    rate: ProviderRate,
    cap_s: float,
    reserved_usd: float,
    summary: Mapping[str, Any] | None = None,
    *,
    started_at: float | None = None,
) -> Settlement:
    """The cost to settle ``a``'s reservation at (see the module docstring).

    ``summary`` is the race state's record of the attempt's result (``state["results"][id]``:
    metrics, cap-cancel receipt); ``rate`` and ``cap_s`` are in the race's time unit;
    ``started_at`` is the race's start (to place the provider's cancel acknowledgement).
    """
    receipt = a.receipt
    if a.submitted_at is None and not a.handle:
        if receipt is not None and receipt.leaked and not receipt.confirmed_terminal:
            note = "submit outcome unknown: a job may exist"
            return Settlement(reserved_usd, UNPROVEN, note)
        return Settlement(0.0, NOT_SUBMITTED, "never submitted")
    if unaccepted(a) and (a.phase is Phase.LEAKED or unverified_end(a)):
        return Settlement(reserved_usd, UNPROVEN, "not shown stopped")
    # the receipt's own figure (the same function prices receipts and records)
    cost = attempt_cost(a, rate, summary, started_at=started_at, cap_s=cap_s)
    if cost.source == REPORTED:
        return Settlement(cost.billed_usd, RECONCILED, "provider-reported execution")
    return Settlement(cost.billed_usd, ESTIMATED, "our clock: submit to result or stop")


__all__ = [
    "ESTIMATED",
    "NOT_SUBMITTED",
    "RECONCILED",
    "UNPROVEN",
    "Settlement",
    "ready_to_settle",
    "reported_active_usd",
    "settle_attempt",
]
