"""A finished race summarised for callers and audits: winner, latency, flags, receipts, cost.

Cost accounting: one rule for receipts, records, the ledger's settlements and the replay.

* active $: what the job's execution cost. The provider's own figure wins whenever it gave one
  (RunPod's ``executionTime`` from a result or a cancel's confirming read: ``cost_usd`` in the
  result's metrics, ``reconciled_cost_usd`` on the receipt). Without one, our clock, from the
  submit to the moment the job is known to have stopped: its result's arrival (also a result
  that came after its cancel), else the latest of the cancel's sending, the provider's
  acknowledgement and, for a confirmed cancel, the end the confirming read saw (the receipt's
  ``terminal_ms``): a janitor's later confirmation of a leaked job prices it to the janitor's
  sighting, an upper bound. A job cancelled while still queued (``was_running`` False) costs
  nothing. A job whose cancel the provider accepted but cannot confirm (Cerebrium) is priced to
  that acknowledgement until a late result says more; one whose cancel was refused or never
  answered, or that passed its cap, is priced at its cap: unknowns count against us. A result
  nothing verified (an unsigned Cerebrium webhook) that ended a job we were cancelling proves
  no end: the job is priced as the leak it was (its cap, or to the cancel's acknowledgement),
  or to the delivery where that costs more; such a delivery only ever raises a price.
* billed $: active $ plus the provider's idle window (``idle_s`` x rate) for every job whose
  worker started.
* wasted $: the active $ of every attempt that did not win.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError
from .attempts import Attempt, Phase, escalated, hedged
from .jobs import JobState
from .race import BUDGET_REFUSED, Race, unverified_end
from .rates import ProviderRate
from .receipts import Evidence


def rates_from_mapping(data: Mapping[str, Any]) -> dict[str, ProviderRate]:
    """Rates from plain data: ``{provider: rate}`` or ``{provider: {rate_per_s, idle_s}}``."""
    rates: dict[str, ProviderRate] = {}
    for name, value in data.items():
        if isinstance(value, ProviderRate):
            rates[name] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            rates[name] = ProviderRate(float(value))
        elif isinstance(value, Mapping):
            try:
                rates[name] = ProviderRate(
                    float(value["rate_per_s"]), float(value.get("idle_s", 0.0))
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(
                    f"expected {{rate_per_s, idle_s}} numbers, got {value!r}", key=f"rates.{name}"
                ) from e
        else:
            raise ConfigError(f"expected a number or a mapping, got {value!r}", key=f"rates.{name}")
    return rates


REPORTED, CLOCK, CAPPED, NONE = "provider", "clock", "cap", "not_sent"


@dataclass(frozen=True)
class AttemptCost:
    """Cost of one attempt: active USD, whether a worker started (its idle window bills), the
    billed total, and where the active figure comes from (``provider``, ``clock``, ``cap``)."""

    active_usd: float
    started: bool
    billed_usd: float
    source: str = CLOCK


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return max(0.0, float(value))


def reported_active_usd(a: Attempt, summary: Mapping[str, Any] | None = None) -> float | None:
    """The execution cost the provider reported for ``a``'s job, if it did.

    ``summary`` is the race state's record of the attempt's result (``state["results"][id]``:
    its metrics and the receipt of a cancel past its cap).
    """
    metrics = (summary or {}).get("metrics") or {}
    cap_cancel = (summary or {}).get("cap_cancel") or {}
    for value in (
        metrics.get("cost_usd"),
        cap_cancel.get("reconciled_cost_usd"),
        a.receipt.reconciled_cost_usd if a.receipt is not None else None,
    ):
        found = _finite(value)
        if found is not None:
            return found
    return None


_STOPPED_BY_US = (JobState.CANCELLED.value, JobState.TIMEOUT.value)


def unaccepted(a: Attempt) -> bool:
    """Whether nothing shows ``a``'s job stopped or even told to stop: a leaked job (or one a
    delivery nothing verified ended) whose provider never accepted its cancel (refused, never
    answered, or not answered yet), or one past its cap."""
    if a.result_state == JobState.TIMEOUT.value:
        return True
    if a.phase is not Phase.LEAKED and not unverified_end(a):
        return False
    r = a.receipt
    return r is None or r.cancel_ack_ms is None or r.evidence.rank < Evidence.PROVIDER_ACK.rank


def _cancel_refused(a: Attempt) -> bool:
    """Whether the provider refused (or never answered) ``a``'s cancel (race_cancels.py)."""
    return any(len(t) > 1 and t[1] == "cancel_refused" for t in a.timeline)


def _stopped_at(a: Attempt, started_at: float | None) -> float | None:
    """When (race-relative s) our clock last knew ``a``'s job to be running, or None if live."""
    r = a.receipt
    if a.cancel_sent_at is None or (
        a.result_at is not None and a.result_state not in _STOPPED_BY_US
    ):
        return a.result_at  # it ended with a result (one after its cancel included)
    if a.result_at is not None and _cancel_refused(a):
        return a.result_at  # seen ended, not by our cancel (refused): billed until then
    stop = a.cancel_sent_at
    if r is not None and r.cancel_ack_ms is not None and started_at is not None:
        # the provider had the cancel by then: the job stopped no later (a cancel that waited
        # for a rate-limit token reached the provider long after it was decided)
        stop = max(stop, r.cancel_ack_ms / 1000.0 - started_at)
    if (
        r is not None
        and r.confirmed_terminal
        and r.terminal_ms is not None
        and started_at is not None
    ):
        # a job may run on a moment after acknowledging its cancel: its end as we saw it
        # bounds the bill from above (the acknowledgement alone can fall short of it)
        stop = max(stop, r.terminal_ms / 1000.0 - started_at)
    return stop


def attempt_cost(
    a: Attempt,
    rate: ProviderRate,
    summary: Mapping[str, Any] | None = None,
    *,
    started_at: float | None = None,
    cap_s: float | None = None,
) -> AttemptCost:
    """Apply the accounting rule above to one attempt.

    ``started_at``: the race's start on its clock (to place the provider's cancel
    acknowledgement); ``cap_s``: the attempt's cap, the price of a job never shown stopped.
    """
    if unverified_end(a):
        # as the delivery left it (a stop the janitor shows later moves no settled figure):
        # priced as the leak it was, or to the delivery where that costs more
        r = a.receipt
        if r is not None and r.confirmed_terminal:
            r = replace(r, confirmed_terminal=False, terminal_status=None, terminal_ms=None)
        delivered_at = replace(a, receipt=r)
        as_leak = replace(delivered_at, phase=Phase.LEAKED, result_state=None, result_at=None)
        held = _priced(as_leak, rate, None, started_at, cap_s)
        delivered = _priced(delivered_at, rate, summary, started_at, cap_s)
        return delivered if delivered.billed_usd > held.billed_usd else held
    return _priced(a, rate, summary, started_at, cap_s)


def _priced(
    a: Attempt,
    rate: ProviderRate,
    summary: Mapping[str, Any] | None,
    started_at: float | None,
    cap_s: float | None,
) -> AttemptCost:
    """The accounting rule (:func:`attempt_cost`), the receipt taken as it stands."""
    if a.submitted_at is None:
        return AttemptCost(0.0, False, 0.0, NONE)
    idle = rate.idle_s * rate.rate_per_s
    reported = reported_active_usd(a, summary)
    if reported is not None:
        started = reported > 0 or a.result_state == JobState.COMPLETED.value
        return AttemptCost(reported, started, reported + (idle if started else 0.0), REPORTED)
    if unaccepted(a) and cap_s is not None:  # a queued job too: nothing shows it left the queue
        active = max(0.0, cap_s) * rate.rate_per_s
        return AttemptCost(active, True, active + idle, CAPPED)
    r = a.receipt
    result_first = a.result_at is not None and (
        a.cancel_sent_at is None or a.result_state != JobState.CANCELLED.value
    )
    if (
        not result_first
        and r is not None
        and r.was_running is False
        and a.cancel_sent_at is not None
    ):
        return AttemptCost(0.0, False, 0.0, CLOCK)  # removed from the queue: no worker started
    stop = _stopped_at(a, started_at)
    seconds = 0.0 if stop is None else stop - a.submitted_at  # still running: nothing known yet
    if cap_s is not None:
        seconds = min(seconds, max(0.0, cap_s))
    active = max(0.0, seconds) * rate.rate_per_s
    return AttemptCost(active, True, active + idle, CLOCK)


@dataclass
class Outcome:
    """What one race came to; ``to_dict`` is what receipts and APIs store."""

    race_id: str
    policy: str
    winner: str | None
    winner_provider: str | None
    latency_s: float | None
    hedged: bool
    cut_over: bool
    escalated: bool
    escalation_waited: bool
    finished: bool
    note: str
    attempts: list[dict[str, Any]] = field(default_factory=list)
    receipts: list[dict[str, Any]] = field(default_factory=list)
    active_usd: float | None = None
    billed_usd: float | None = None
    wasted_usd: float | None = None
    budget_refused: bool = False  # the budget refused an attempt: it was never sent
    # a cutover whose cancel found the primary already running: a hedge with both billed
    cutover_late: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _cutover_cancel_found_it_running(race: Race) -> bool:
    return any(
        (a.cancel_reason or "").startswith("cutover")
        and a.receipt is not None
        and a.receipt.was_running is True
        for a in race.attempts
    )


def cut_over(race: Race) -> bool:
    """Whether the race cut over: cancelled its primary while still queued. A cutover whose
    cancel reached the provider only after the job had started (it waited for a rate-limit
    token, say) is no cutover: both jobs ran, as in a hedge (:func:`cutover_late`)."""
    return "cut_over" in race.flags and not _cutover_cancel_found_it_running(race)


def cutover_late(race: Race) -> bool:
    """Whether the race decided a cutover whose cancel found the primary already running."""
    return "cut_over" in race.flags and _cutover_cancel_found_it_running(race)


def race_outcome(
    race: Race,
    rates: Mapping[str, ProviderRate] | None = None,
    results: Mapping[str, Any] | None = None,
    caps_s: Mapping[str, float] | None = None,
) -> Outcome:
    """Summarise ``race``; with ``rates`` (every launched provider needed) it also prices it.

    ``results``: the race state's result summaries by attempt id (the provider's figures);
    ``caps_s``: each provider's cap (the price of a job never shown stopped). Each attempt's
    summary then carries its own ``usd``, ``billed_usd`` and ``cost_source``.
    """
    won = race.winner_attempt
    outcome = Outcome(
        race_id=race.race_id,
        policy=race.policy.name,
        winner=race.winner,
        winner_provider=won.provider if won else None,
        latency_s=race.latency(),
        hedged=hedged(race.attempts),
        cut_over=cut_over(race),
        cutover_late=cutover_late(race),
        escalated=escalated(race.attempts),
        escalation_waited="escalation_waited" in race.flags,
        finished=race.finished,
        note=race.note,
        attempts=[_attempt_summary(a) for a in race.attempts],
        receipts=[a.receipt.to_dict() for a in race.attempts if a.receipt is not None],
        budget_refused=BUDGET_REFUSED in race.flags,
    )
    if rates is not None:
        active = billed = wasted = 0.0
        for a, summary in zip(race.attempts, outcome.attempts, strict=True):
            rate = rates.get(a.provider)
            if rate is None:
                raise ConfigError(f"no rate for provider {a.provider!r}", key="rates")
            cap = None if caps_s is None else caps_s.get(a.provider)
            found = (results or {}).get(a.id)
            cost = attempt_cost(a, rate, found, started_at=race.started_at, cap_s=cap)
            summary.update(usd=cost.active_usd, billed_usd=cost.billed_usd, cost_source=cost.source)
            active += cost.active_usd
            billed += cost.billed_usd
            if a.id != race.winner:
                wasted += cost.active_usd
        outcome.active_usd, outcome.billed_usd, outcome.wasted_usd = active, billed, wasted
    return outcome


def _attempt_summary(a: Attempt) -> dict[str, Any]:
    return {
        "id": a.id,
        "provider": a.provider,
        "role": a.role,
        "job_id": a.job_id,
        "phase": a.phase.value,
        "sent": a.sent,
        "state": a.result_state or a.last_state,
        "valid": a.valid,
        "reasons": list(a.reasons),
        "timeline": [list(t) for t in a.timeline],
    }
