"""A race's receipt and result: what the caller gets, what the audit keeps, how to read them.

* :func:`winner_result` is the Celery result of ``hedged_infer``, built the moment a winner is
  declared: winner provider, payload (or ``payload_ref`` for payloads over the inline limit),
  end-to-end ms, whether it hedged (and whether the budget refused an attempt), and the race id.
* :func:`assemble_receipt` is the full audit written once every attempt is settled: every
  attempt with its state timeline, provider metrics and job handle, every loser's cancel
  receipt, cost ($ active, billed, wasted) and leaks.
* :func:`by_reference` is that result as the Celery result backend stores it: a payload
  already stored with its attempt's result is referred to by key, not copied (the backend's
  reads put it back with :func:`with_payload`: ``tasks/race_backend.py``).
* :func:`read_receipt` reads it back by race id (or a provisional one while the race runs).
* :func:`race_record` is the compact record of a finished race for the record stream.
"""

from __future__ import annotations

import logging
from typing import Any

from ..core.attempts import hedged
from ..core.outcome import race_outcome
from ..core.race import BUDGET_REFUSED, Race
from ..core.records import build_record, record_tags
from ..store import codec
from ..store.race_keys import RaceShards
from ..store.races import RaceStore
from ..store.timers import store_errors
from .spec import RaceSpec

RECEIPT_VERSION = 1

log = logging.getLogger(__name__)


def result_key(shards: RaceShards, race_id: str, attempt_id: str) -> str:
    """Redis key of an attempt's valid result (payload included), on the race's slot."""
    base = shards.race(race_id).state.rsplit(":", 1)[0]
    return f"{base}:result:{attempt_id}"


def load_attempt_result(
    client: Any, shards: RaceShards, race_id: str, attempt_id: str
) -> dict[str, Any] | None:
    """An attempt's stored result (with its ``verdict`` and ``payload_bytes``), None when it
    was never stored or has expired."""
    with store_errors(f"reading a result of race {race_id!r}"):
        raw = client.get(result_key(shards, race_id, attempt_id))
    return None if raw is None else codec.loads(raw)


def load_payload(result: dict[str, Any], client: Any) -> Any:
    """The winner's payload of a ``hedged_infer`` result, fetched from Redis when referenced."""
    if "payload_ref" not in result:
        return result.get("payload")
    with store_errors("reading a referenced payload"):
        raw = client.get(result["payload_ref"])
    if raw is None:
        raise LookupError(f"payload {result['payload_ref']!r} has expired or never existed")
    return codec.loads(raw).get("payload")


def winner_result(
    race: Race,
    stored: dict[str, Any],
    *,
    inline_max: int,
    ref: str,
) -> dict[str, Any]:
    """The caller's result for the race's winner (``stored`` is its stored attempt result)."""
    won = race.winner_attempt
    assert won is not None
    latency = race.latency()
    result: dict[str, Any] = {
        "race_id": race.race_id,
        "winner": won.provider,
        "attempt": won.id,
        "role": won.role,
        "policy": race.policy.name,
        "hedged": hedged(race.attempts),  # a second job was sent, not merely launched
        "budget_refused": BUDGET_REFUSED in race.flags,
        # from the race's start to its winning result being known (the same on every re-mark)
        "e2e_ms": None if won.result_at is None else round(won.result_at * 1000.0, 3),
        "latency_ms": None if latency is None else round(latency * 1000.0, 3),
        "provider_ms": stored.get("wall_ms"),
        "job_id": won.job_id,
    }
    payload = stored.get("payload")
    size = 0
    if inline_max >= 0:  # measured once, when the result was stored (else: measured now)
        stored_size = stored.get("payload_bytes")
        size = codec.size(payload) if stored_size is None else int(stored_size)
    if size > inline_max >= 0:
        result["payload_ref"] = ref
        result["payload_bytes"] = size
    else:
        result["payload"] = payload
    return result


PAYLOAD_INLINE = "payload_inline"  # a stored result's payload_ref that readers put back inline
REF_MIN_BYTES = 1024  # smaller payloads stay inline (a GET would cost the caller more)


def by_reference(result: dict[str, Any], ref: str) -> dict[str, Any]:
    """``result`` as the result backend stores it: an inline payload of at least
    :data:`REF_MIN_BYTES` is replaced by ``ref`` (the key of the stored attempt result that
    holds it) in the documented form for large payloads (``payload_ref``, ``payload_bytes``),
    marked ``payload_inline`` for :func:`with_payload`; anything else is returned unchanged."""
    payload = result.get("payload")
    if payload is None:
        return result
    size = codec.size(payload)
    if size < REF_MIN_BYTES:
        return result
    stored = {k: v for k, v in result.items() if k != "payload"}
    stored.update(payload_ref=ref, payload_bytes=size)
    stored[PAYLOAD_INLINE] = True
    return stored


def with_payload(result: dict[str, Any], client: Any) -> dict[str, Any]:
    """The caller's result from one :func:`by_reference` stored: the payload read back from
    its key and inline again (left as ``payload_ref`` + ``payload_bytes`` if it expired)."""
    out = {k: v for k, v in result.items() if k != PAYLOAD_INLINE}
    raw = client.get(out["payload_ref"])
    if raw is None:
        return out
    del out["payload_ref"], out["payload_bytes"]
    out["payload"] = codec.loads(raw).get("payload")
    return out


def assemble_receipt(
    race: Race, state: dict[str, Any], spec: RaceSpec, *, now: float
) -> dict[str, Any]:
    """The full audit of a race: the engine's outcome enriched with handles and metrics."""
    results = state.get("results") or {}
    caps = (state.get("spec") or {}).get("caps_s") or {}
    outcome = race_outcome(race, spec.provider_rates(), results, caps).to_dict()
    by_id = {a.id: a for a in race.attempts}
    for summary in outcome["attempts"]:
        a = by_id[summary["id"]]
        found = results.get(a.id) or {}
        summary["handle"] = a.handle
        summary["metrics"] = found.get("metrics", {})
        summary["provider_events"] = found.get("events", [])
        summary["error"] = found.get("error")
        summary["launched_at_s"] = a.launched_at
        summary["submitted_at_s"] = a.submitted_at
        summary["result_at_s"] = a.result_at
        summary["cancel_receipt"] = a.receipt.to_dict() if a.receipt else None
        summary["cap_cancel"] = found.get("cap_cancel")
    leaks = [
        {"attempt": a.id, "provider": a.provider, "job_id": a.job_id}
        for a in race.attempts
        if (a.receipt is not None and a.receipt.leaked) or _capped_running(a, results)
    ]
    outcome.update(
        {
            "version": RECEIPT_VERSION,
            "kind": "race",
            "leaks": leaks,
            "leaked": bool(leaks),
            "created_at": state.get("created_at"),
            "won_at": _won_at(race),
            "finished_at": now if race.finished else None,
            "validator": spec.validator,
            "time_scale": spec.time_scale,
            "budget_key": spec.budget_key,
            "failure_reason": _failure_reason(race),
            # who stopped the race (``cli``, ``revoke`` or a caller's word) and when (epoch s)
            "stopped_by": race.stopped_by,
            "stopped_at": race.stopped_at,
            "latency_ms": None if outcome["latency_s"] is None else outcome["latency_s"] * 1000.0,
        }
    )
    return outcome


def race_record(
    store: RaceStore, race: Race, state: dict[str, Any], spec: RaceSpec, receipt: dict[str, Any]
) -> dict[str, Any] | None:
    """The record to append with the race's receipt; None when the store keeps no records.

    A record is for reports: one that cannot be built is logged and left out, and the race
    finishes all the same.
    """
    if not store.records.enabled:
        return None
    try:
        return build_record(race, receipt, spec.provider_rates(), **record_tags(state))
    except Exception:
        log.warning("race %s: its record could not be built", race.race_id, exc_info=True)
        return None


def _failure_reason(race: Race) -> str | None:
    """Why a finished race has no winner: ``budget`` when the budget refused an attempt;
    ``stopped`` for a stopped race, from the stop on (its caller is failed then)."""
    if race.winner is None and race.stopped_by is not None:
        return "stopped"
    if race.winner is not None or not race.finished:
        return None
    return "budget" if BUDGET_REFUSED in race.flags else "no_valid_result"


def _capped_running(a: Any, results: dict[str, Any]) -> bool:
    """A job that passed its cap and is not (yet) shown stopped by its own cancel."""
    if a.result_state != "TIMEOUT" or not a.handle:
        return False
    cancel = (results.get(a.id) or {}).get("cap_cancel") or {}
    return not cancel.get("confirmed_terminal")


def _won_at(race: Race) -> float | None:
    won = race.winner_attempt
    if won is None or won.result_at is None or race.started_at is None:
        return None
    return race.started_at + won.result_at


def read_receipt(store: RaceStore, race_id: str) -> dict[str, Any] | None:
    """The race's receipt; while it runs, a provisional one (``finished`` false); else None."""
    found = store.receipt(race_id)
    if found is not None:
        return found
    record = store.load(race_id)
    if record is None:
        return None
    from ..core.clock import WallClock
    from .spec import spec_from_state

    race = Race.from_dict(record.state["race"], WallClock())
    return assemble_receipt(
        race, record.state, spec_from_state(record.state), now=WallClock().now()
    )
