"""Race records: one compact, self-contained line per finished race, for reports over weeks.

A receipt is the full audit of one race and lives in Redis for a day; a record is the part of
it a latency/cost report needs, small enough to keep 100,000 of them in a capped stream and to
export as JSONL (``docs/records.md`` documents every field). This module is pure: the driver
builds a record from the finished race and its receipt, the store appends it.

Times are epoch seconds; durations are milliseconds of real time; money is USD at the rates the
race ran with (provider time, as the receipt prices it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .outcome import attempt_cost
from .race import Race
from .rates import ProviderRate

RECORD_VERSION = 1
RECORD_KIND = "race"


def _r(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def record_tags(state: Mapping[str, Any]) -> dict[str, Any]:
    """The budget key and arm a race was started with, from its stored state (None if absent).

    Either may sit at the top of the state or in its resolved spec; whoever starts a race with
    a budget or as an experiment's arm puts it there, and the record carries it.
    """
    spec = state.get("spec") or {}
    return {
        "budget_key": state.get("budget_key", spec.get("budget_key")),
        "arm": state.get("arm", spec.get("arm")),
    }


def build_record(
    race: Race,
    receipt: Mapping[str, Any],
    rates: Mapping[str, ProviderRate],
    *,
    budget_key: str | None = None,
    arm: str | None = None,
) -> dict[str, Any]:
    """The record of a finished ``race`` whose ``receipt`` was just assembled.

    Each attempt's cost is the receipt's own (one figure per job); ``rates`` price a receipt
    assembled before its attempts carried costs.
    """
    won = race.winner_attempt
    e2e_ms = winner_ms = None
    if won is not None and won.result_at is not None:
        e2e_ms = won.result_at * 1000.0
        if won.submitted_at is not None:
            winner_ms = (won.result_at - won.submitted_at) * 1000.0
    attempts = []
    cancels = []
    priced = {p.get("id"): p for p in receipt.get("attempts") or ()}
    for a in race.attempts:
        found = priced.get(a.id) or {}
        usd, billed = found.get("usd"), found.get("billed_usd")
        rate = rates.get(a.provider)
        if usd is None and rate is not None:  # a receipt priced before attempts carried costs
            cost = attempt_cost(a, rate, started_at=race.started_at)
            usd, billed = cost.active_usd, cost.billed_usd
        entry = {
            "provider": a.provider,
            "role": a.role,
            "state": a.result_state or a.last_state,
            "usd": _r(usd, 6),
            "billed_usd": _r(billed, 6),
        }
        if not a.sent:  # only then: a record stays as small as it can
            entry["sent"] = False
        attempts.append(entry)
        c = a.receipt
        if c is not None and a.id != race.winner and a.sent:  # no job, nothing was cancelled
            ack = None
            if c.cancel_ack_ms is not None and c.cancel_sent_ms is not None:
                ack = round(c.cancel_ack_ms - c.cancel_sent_ms, 1)
            cancels.append(
                {
                    "provider": a.provider,
                    "evidence": c.evidence.value,
                    "was_running": c.was_running,
                    "terminal": c.terminal_status.value if c.terminal_status else None,
                    "ack_ms": ack,
                    "leaked": c.leaked,
                }
            )
    return {
        "v": RECORD_VERSION,
        "kind": RECORD_KIND,
        "race_id": race.race_id,
        "ts": _r(receipt.get("finished_at"), 3),
        "started": _r(receipt.get("created_at"), 3),
        "policy": race.policy.name,
        "providers": list(race.policy.providers()),
        "winner": won.provider if won is not None else None,
        "e2e_ms": _r(e2e_ms, 1),
        "winner_ms": _r(winner_ms, 1),
        "hedged": bool(receipt.get("hedged")),
        "cut_over": bool(receipt.get("cut_over")),
        "cutover_late": bool(receipt.get("cutover_late")),
        "escalated": bool(receipt.get("escalated")),
        "budget_refused": bool(receipt.get("budget_refused")),
        "attempts": attempts,
        "cancels": cancels,
        "leaked": bool(receipt.get("leaked")),
        "usd": _r(receipt.get("active_usd"), 6),
        "billed_usd": _r(receipt.get("billed_usd"), 6),
        "wasted_usd": _r(receipt.get("wasted_usd"), 6),
        "budget_key": budget_key,
        "arm": arm,
        "time_scale": receipt.get("time_scale", 1.0),
    }
