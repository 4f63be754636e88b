"""A finished race summarised for callers and audits: winner, latency, flags, receipts, cost.

Cost accounting (the same rule the replay and the published tables use):

* active $: each job is billed from its submit until its result arrived or its cancel was sent,
  at the provider's per-second rate; a job cancelled while still queued (``was_running`` is
  False on its receipt) costs nothing. A job whose cancel state is unknown is billed: unknowns
  are counted against us, never for us.
* billed $: active $ plus the provider's idle window (``idle_s`` x rate) for every job whose
  worker started.
* wasted $: the active $ of every attempt that did not win.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .attempts import Attempt, escalated, hedged
from .race import BUDGET_REFUSED, Race


@dataclass(frozen=True)
class ProviderRate:
    """What one provider charges: USD per second of execution and an idle window per start."""

    rate_per_s: float
    idle_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_per_s < 0 or self.idle_s < 0:
            raise ConfigError(f"rates must be >= 0, got {self.rate_per_s}/s and {self.idle_s} s")


#: The rates GPUHedge's published tables used (USD per second; RunPod bills a 60 s idle window).
PUBLISHED_RATES: dict[str, ProviderRate] = {
    "runpod": ProviderRate(0.000306, 60.0),
    "modal": ProviderRate(0.000704),
    "cerebrium": ProviderRate(0.000736),
}


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


@dataclass(frozen=True)
class AttemptCost:
    """Cost of one attempt: active USD, and whether a worker started (its idle window bills)."""

    active_usd: float
    started: bool
    billed_usd: float


def attempt_cost(a: Attempt, rate: ProviderRate) -> AttemptCost:
    """Apply the accounting rule above to one attempt."""
    if a.submitted_at is None:
        return AttemptCost(0.0, False, 0.0)
    cancelled_first = a.cancel_sent_at is not None and (
        a.result_at is None or a.result_at > a.cancel_sent_at
    )
    if cancelled_first:
        if a.receipt is not None and a.receipt.was_running is False:
            return AttemptCost(0.0, False, 0.0)  # removed from the queue: no worker started
        seconds = a.cancel_sent_at - a.submitted_at  # type: ignore[operator]
    elif a.result_at is not None:
        seconds = a.result_at - a.submitted_at
    else:
        seconds = 0.0  # still running: nothing known yet
    active = max(0.0, seconds) * rate.rate_per_s
    return AttemptCost(active, True, active + rate.idle_s * rate.rate_per_s)


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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def race_outcome(race: Race, rates: Mapping[str, ProviderRate] | None = None) -> Outcome:
    """Summarise ``race``; with ``rates`` (every launched provider needed) it also prices it."""
    won = race.winner_attempt
    outcome = Outcome(
        race_id=race.race_id,
        policy=race.policy.name,
        winner=race.winner,
        winner_provider=won.provider if won else None,
        latency_s=race.latency(),
        hedged=hedged(race.attempts),
        cut_over="cut_over" in race.flags,
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
        for a in race.attempts:
            rate = rates.get(a.provider)
            if rate is None:
                raise ConfigError(f"no rate for provider {a.provider!r}", key="rates")
            cost = attempt_cost(a, rate)
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
