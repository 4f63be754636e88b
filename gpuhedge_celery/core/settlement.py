"""What an ended attempt cost, for settling its budget reservation (pure).

Three sources, best first:

* ``reconciled``: the provider reported the job's billed execution (a result's ``cost_usd`` /
  ``execution_ms`` metric, or a cancel receipt's ``reconciled_cost_usd``), plus the idle window
  of the worker it started;
* ``estimated``: our own clock, the accounting rule of :mod:`.outcome` (submit to result or to
  the cancel, nothing for a job cancelled while queued), capped at the attempt's cap;
* ``unproven``: nothing shows the job stopped (its cancel was never confirmed, or its submit's
  outcome is unknown): the whole reservation is kept as spent. Unknowns count against us.

An attempt that was never submitted costs nothing (``not_submitted``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .attempts import Attempt, Phase
from .jobs import JobState
from .outcome import ProviderRate, attempt_cost

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


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def reported_active_usd(a: Attempt, summary: Mapping[str, Any] | None) -> float | None:
    """The active (execution) cost the provider reported, if it did."""
    metrics = (summary or {}).get("metrics") or {}
    cap_cancel = (summary or {}).get("cap_cancel") or {}
    for value in (
        metrics.get("cost_usd"),
        cap_cancel.get("reconciled_cost_usd"),
        a.receipt.reconciled_cost_usd if a.receipt is not None else None,
    ):
        found = _number(value)
        if found is not None:
            return max(0.0, found)
    return None


def settle_attempt(
    a: Attempt,
    rate: ProviderRate,
    cap_s: float,
    reserved_usd: float,
    summary: Mapping[str, Any] | None = None,
) -> Settlement:
    """The cost to settle ``a``'s reservation at (see the module docstring).

    ``summary`` is the race state's record of the attempt's result (``state["results"][id]``:
    metrics, cap-cancel receipt); ``rate`` and ``cap_s`` are in the race's time unit.
    """
    receipt = a.receipt
    if a.submitted_at is None and not a.handle:
        if receipt is not None and receipt.leaked and not receipt.confirmed_terminal:
            note = "submit outcome unknown: a job may exist"
            return Settlement(reserved_usd, UNPROVEN, note)
        return Settlement(0.0, NOT_SUBMITTED, "never submitted")
    if a.phase is Phase.LEAKED:
        return Settlement(reserved_usd, UNPROVEN, "not shown stopped")
    cancelled_first = a.cancel_sent_at is not None and (
        a.result_at is None or a.result_at > a.cancel_sent_at
    )
    queued_cancel = cancelled_first and receipt is not None and receipt.was_running is False
    idle = 0.0 if queued_cancel else rate.idle_s * rate.rate_per_s
    reported = reported_active_usd(a, summary)
    if reported is not None:
        return Settlement(reported + idle, RECONCILED, "provider-reported execution")
    ceiling = max(0.0, cap_s) * rate.rate_per_s
    active = min(attempt_cost(a, rate).active_usd, ceiling)
    if a.result_state == JobState.TIMEOUT.value:
        active = ceiling  # it ran to its cap (and on until its cancel landed)
    return Settlement(active + idle, ESTIMATED, "our clock: submit to result or cancel")


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
