"""What the product reports about money, against what the provider fakes know was billed (pure).

The loopback fakes keep every job's billing truth (``GET /admin/truth``: when its worker
started, whether a cancel stopped it, ``billed_s`` from its start to its end or stop). This
module lines that up with the product's three views of each attempt and of the whole run:

* the receipt: each attempt's ``usd`` / ``billed_usd`` where the receipt carries them, else the
  receipt's accounting rule recomputed from the attempt's times (``receipt_cost``:
  ``recomputed``); the receipt's ``wasted_usd`` per race;
* the race record: each attempt's ``usd`` / ``billed_usd`` (``records export``);
* the budget ledger: each attempt's settlement (``ledger export``: ``settle`` entries).

Truth $ of a job = ``billed_s`` x the provider's ``billed_rate_per_s`` (active), plus its
``idle_billed_seconds`` x rate when its worker started (billed), the rule the product bills by.
:func:`compare` (pure) returns plain data (JSON) for tests and ``bench races --rows truth``;
:func:`gather` reads the product's side from Redis.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..core.rates import ProviderRate

REL_TOL = 0.05  # two figures agree within 5 % ...
ABS_TOL_USD = 1e-6  # ... or within a micro-dollar (rounding of records and nano-dollars)
SHOWN = 20  # disagreements listed in full (the counts cover all)


def rates_from_config(config: Any) -> dict[str, ProviderRate]:
    """Each provider's rate and idle window, from a loaded config."""
    return {
        name: ProviderRate(float(p.billed_rate_per_s), float(p.idle_billed_seconds))
        for name, p in config.providers.items()
    }


def agree(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= max(ABS_TOL_USD, REL_TOL * max(abs(a), abs(b)))


def _cancel_sent_at(attempt: Mapping[str, Any]) -> float | None:
    """The race's time of the attempt's first cancel (its timeline's ``cancel_sent`` line)."""
    for at, label in attempt.get("timeline") or []:
        if str(label).startswith("cancel_sent"):
            return float(at)
    return None


def receipt_attempt_cost(attempt: Mapping[str, Any], rate: ProviderRate) -> tuple[float, float]:
    """(active, billed) USD of one receipt attempt: the receipt's own ``usd`` / ``billed_usd``
    when it carries them, else the receipt's accounting rule recomputed from its times (submit
    to result or to the cancel decision; nothing for a job cancelled while queued)."""
    if attempt.get("usd") is not None and attempt.get("billed_usd") is not None:
        return float(attempt["usd"]), float(attempt["billed_usd"])
    submitted = attempt.get("submitted_at_s")
    if submitted is None:
        return 0.0, 0.0
    cancel = attempt.get("cancel_receipt") or {}
    result_at, cancel_at = attempt.get("result_at_s"), _cancel_sent_at(attempt)
    if cancel_at is not None and (result_at is None or result_at > cancel_at):
        if cancel.get("was_running") is False:
            return 0.0, 0.0
        seconds = cancel_at - float(submitted)
    else:
        seconds = 0.0 if result_at is None else float(result_at) - float(submitted)
    active = max(0.0, seconds) * rate.rate_per_s
    return active, active + rate.idle_s * rate.rate_per_s


def truth_cost(truth: Mapping[str, Any], rate: ProviderRate) -> tuple[float, float]:
    """(active, billed) USD the provider billed for one job by the fake's truth."""
    active = float(truth.get("billed_s") or 0.0) * rate.rate_per_s
    idle = rate.idle_s * rate.rate_per_s if truth.get("started") is not None else 0.0
    return active, active + idle


def truth_kind(t: Mapping[str, Any] | None) -> str:
    """What happened to a job at the provider, in one word (the per-kind summary's key)."""
    if t is None:
        return "unknown"
    if t.get("started") is None:
        return "cancelled_queued" if t.get("stopped_by_cancel") else "never_started"
    if t.get("late_result"):
        return "late_result"
    if t.get("stopped_by_cancel"):
        return "stopped_running"
    return "refused_cancel_ran_on" if t.get("cancel_refusals") else "ran_to_end"


def _by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Attempts grouped by provider, won or lost, and what the job did: truth beside the
    receipt's and the ledger's figures (USD), where a mismatch comes from at a glance."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = f"{row['provider']} {'won' if row['winner'] else 'lost'} {row['kind']}"
        g = out.setdefault(
            key,
            {
                "attempts": 0,
                "truth_active": 0.0,
                "receipt_active": 0.0,
                "truth_billed": 0.0,
                "receipt_billed": 0.0,
                "ledger": 0.0,
                "unsettled": 0,
                "cancel_reached_provider": 0,
                "cancel_refusals": 0,
                "sources": {},
                "example": {
                    k: row[k]
                    for k in (
                        "race",
                        "attempt",
                        "job",
                        "state",
                        "timeline",
                        "receipt",
                        "truth",
                        "ledger",
                    )
                },
            },
        )
        t = row["truth"] or {}
        g["attempts"] += 1
        g["truth_active"] += t.get("active_usd") or 0.0
        g["truth_billed"] += t.get("billed_usd") or 0.0
        g["cancel_reached_provider"] += 1 if t.get("cancel_requested") else 0
        g["cancel_refusals"] += int(t.get("cancel_refusals") or 0)
        g["receipt_active"] += row["receipt"]["active_usd"] or 0.0
        g["receipt_billed"] += row["receipt"]["billed_usd"] or 0.0
        if row["ledger"] is None:
            g["unsettled"] += 1
        else:
            g["ledger"] += row["ledger"]["settled_usd"] or 0.0
        src = str(row["receipt"].get("cost_source"))
        g["sources"][src] = g["sources"].get(src, 0) + 1
    for g in out.values():
        for k in ("truth_active", "receipt_active", "truth_billed", "receipt_billed", "ledger"):
            g[k] = _r(g[k])
    return dict(sorted(out.items()))


def _ledger_settlements(entries: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], dict]:
    out: dict[tuple[str, str], dict] = {}
    for e in entries:
        if e.get("type") in ("settle", "adjust"):  # an adjust: a late result's difference
            key = (str(e.get("race")), str(e.get("attempt")))
            found = out.setdefault(key, {"usd": 0.0, "sources": [], "count": 0})
            found["usd"] += int(e.get("nano") or 0) / 1e9
            found["sources"].append(e.get("source"))
            found["count"] += e.get("type") == "settle"
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 7)


def _pct(found: float, truth: float) -> float | None:
    return None if truth == 0 else round(100.0 * (found - truth) / truth, 2)


def compare(
    truth: Mapping[str, Mapping[str, Any]],
    rates: Mapping[str, ProviderRate],
    receipts: Iterable[Mapping[str, Any]],
    records: Iterable[Mapping[str, Any]],
    ledger: Iterable[Mapping[str, Any]],
    open_reservations: int,
) -> dict[str, Any]:
    """Every attempt's truth $ beside its receipt, record and ledger figures, and the totals.

    ``truth``: job id -> the fakes' truth (every fake's ``truth()`` merged); ``ledger``: the
    ledger stream's entries; ``open_reservations``: the ledger's open index, counted now.
    """
    receipts = list(receipts)
    by_race_record = {r.get("race_id"): r for r in records}
    settled = _ledger_settlements(ledger)
    jobs: list[dict[str, Any]] = []
    seen_jobs: set[str] = set()
    totals = {
        "wasted_truth": 0.0,
        "wasted_receipts": 0.0,
        "wasted_receipt_attempts": 0.0,
        "spend_truth": 0.0,
        "spend_ledger": 0.0,
        "spend_receipts": 0.0,
        "spend_records": 0.0,
    }
    missing: dict[str, int] = {"record": 0, "ledger_settlement": 0, "truth": 0}
    ack_refused: list[dict[str, Any]] = []
    for receipt in receipts:
        race_id = receipt.get("race_id")
        record = by_race_record.get(race_id)
        totals["wasted_receipts"] += float(receipt.get("wasted_usd") or 0.0)
        for i, a in enumerate(receipt.get("attempts") or []):
            rate = rates[a["provider"]]
            won = a["id"] == receipt.get("winner")
            r_active, r_billed = receipt_attempt_cost(a, rate)
            rec = (record or {}).get("attempts") or []
            rec_a = rec[i] if i < len(rec) else None
            led = settled.get((str(race_id), str(a["id"])))
            job_id = a.get("job_id") or ""
            t = truth.get(job_id) if job_id else None
            if job_id:
                seen_jobs.add(job_id)
            t_active, t_billed = truth_cost(t, rate) if t is not None else (None, None)
            cancel = a.get("cancel_receipt") or {}
            row = {
                "race": race_id,
                "attempt": a["id"],
                "provider": a["provider"],
                "job": job_id,
                "winner": won,
                "state": a.get("state"),
                "kind": truth_kind(t),
                "timeline": [f"{float(at):.2f} {label}" for at, label in a.get("timeline") or []],
                "truth": None
                if t is None
                else {
                    "billed_s": _r(t.get("billed_s")),
                    "started": t.get("started") is not None,
                    "stopped_by_cancel": t.get("stopped_by_cancel"),
                    "cancel_refusals": t.get("cancel_refusals"),
                    "cancel_requested": t.get("cancel_requested_at") is not None,
                    "late_result": t.get("late_result", False),
                    "ended": t.get("ended"),
                    "active_usd": _r(t_active),
                    "billed_usd": _r(t_billed),
                },
                "receipt": {
                    "active_usd": _r(r_active),
                    "billed_usd": _r(r_billed),
                    "cost_source": a.get("cost_source"),
                    "receipt_cost": "own" if a.get("usd") is not None else "recomputed",
                    "was_running": cancel.get("was_running"),
                    "evidence": cancel.get("evidence"),
                    "reconciled_cost_usd": cancel.get("reconciled_cost_usd"),
                    "execution_ms_before_cancel": cancel.get("execution_ms_before_cancel"),
                    "leaked": cancel.get("leaked"),
                },
                "record": None
                if rec_a is None
                else {"active_usd": rec_a.get("usd"), "billed_usd": rec_a.get("billed_usd")},
                "ledger": None
                if led is None
                else {"settled_usd": _r(led["usd"]), "sources": led["sources"]},
            }
            problems = []
            if t is None and job_id:
                missing["truth"] += 1
                problems.append("job unknown to the fake")
            if rec_a is None:
                missing["record"] += 1
                problems.append("no record")
            elif not agree(r_billed, rec_a.get("billed_usd")):
                problems.append("receipt billed != record billed")
            if led is None and a.get("sent"):
                missing["ledger_settlement"] += 1
                problems.append("no ledger settlement")
            elif led is not None:
                if led["count"] > 1:
                    problems.append(f"settled {led['count']} times")
                if not agree(r_billed, led["usd"]):
                    problems.append("receipt billed != ledger settled")
                if rec_a is not None and not agree(rec_a.get("billed_usd"), led["usd"]):
                    problems.append("record billed != ledger settled")
            if t is not None:
                if not agree(r_active, t_active):
                    problems.append("receipt active != truth active")
                if led is not None and not agree(led["usd"], t_billed):
                    problems.append("ledger settled != truth billed")
                refused = (t.get("cancel_refusals") or 0) > 0
                if cancel.get("evidence") == "provider_ack" and refused:
                    ack_refused.append(
                        {
                            "race": race_id,
                            "attempt": a["id"],
                            "job": job_id,
                            "provider": a["provider"],
                            "cancel_accepted_later": t.get("cancel_requested_at") is not None,
                        }
                    )
            row["disagreements"] = problems
            jobs.append(row)
            if not won:
                totals["wasted_receipt_attempts"] += r_active
                totals["wasted_truth"] += t_active or 0.0
            totals["spend_truth"] += t_billed or 0.0
            totals["spend_receipts"] += r_billed
            totals["spend_records"] += float((rec_a or {}).get("billed_usd") or 0.0)
            totals["spend_ledger"] += 0.0 if led is None else led["usd"]
    orphans = sorted(set(truth) - seen_jobs)
    for job_id in orphans:  # billed by a provider, in no receipt: spend all the same
        t = truth[job_id]
        orphan_rate = rates.get(str(t.get("provider") or ""))
        if orphan_rate is not None:
            totals["spend_truth"] += truth_cost(t, orphan_rate)[1]
    disagreeing = [j for j in jobs if j["disagreements"]]
    kinds: dict[str, int] = {}
    for j in disagreeing:
        for p in j["disagreements"]:
            kinds[p] = kinds.get(p, 0) + 1
    return {
        "races": len(receipts),
        "attempts": len(jobs),
        "jobs_in_truth": len(truth),
        "jobs_not_ended": sorted(k for k, t in truth.items() if not t.get("ended")),
        "jobs_in_no_receipt": orphans,
        "wasted_usd": {
            "truth": _r(totals["wasted_truth"]),
            "receipts": _r(totals["wasted_receipts"]),
            "receipt_attempts": _r(totals["wasted_receipt_attempts"]),
            "receipts_vs_truth_pct": _pct(totals["wasted_receipts"], totals["wasted_truth"]),
        },
        "settled_usd": {
            "truth_billed": _r(totals["spend_truth"]),
            "ledger": _r(totals["spend_ledger"]),
            "receipts_billed": _r(totals["spend_receipts"]),
            "records_billed": _r(totals["spend_records"]),
            "ledger_vs_truth_pct": _pct(totals["spend_ledger"], totals["spend_truth"]),
        },
        "open_reservations": open_reservations,
        "missing": missing,
        "provider_ack_but_refused": ack_refused,
        "disagreement_counts": kinds,
        "by_kind": _by_kind(jobs),
        "attempts_disagreeing": len(disagreeing),
        "disagreements": disagreeing[:SHOWN],
        "late_results": sum(1 for t in truth.values() if t.get("late_result")),
        "cancel_refusals": sum(int(t.get("cancel_refusals") or 0) for t in truth.values()),
        "what": (
            "truth: the fakes' billed_s x rate (+ idle x rate per started worker); "
            "receipt per attempt: its usd / billed_usd, else the receipt's rule "
            "recomputed from its times; record: records' attempts usd / "
            "billed_usd; ledger: settle entries"
        ),
    }


def merge_truth(**by_provider: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """One job id -> truth map from each fake's ``truth()``, tagged with its provider name."""
    out: dict[str, dict[str, Any]] = {}
    for provider, jobs in by_provider.items():
        for job_id, t in jobs.items():
            out[job_id] = {**t, "provider": provider}
    return out


def gather(client: Any, prefix: str, race_ids: Iterable[str]) -> dict[str, Any]:
    """The product's side of :func:`compare` from Redis: the races' receipts (those written),
    every race record and ledger entry under ``prefix``, and the open reservations now."""
    from ..store.budget import BudgetStore
    from ..store.races import RaceStore

    store = RaceStore(client, prefix)
    budget = BudgetStore(client, prefix)
    receipts = [r for r in (store.receipt(i) for i in race_ids) if r is not None]
    return {
        "receipts": receipts,
        "records": [r for _, r in store.records.read()],
        "ledger": [e for _, e in budget.entries()],
        "open_reservations": budget.open_count(),
    }


__all__ = [
    "agree",
    "compare",
    "gather",
    "merge_truth",
    "rates_from_config",
    "receipt_attempt_cost",
    "truth_cost",
]
