"""Live-traffic statistics: read request records of two formats, group them, summarise each group.

Two formats are read, one JSON object per line:

* **ours** (``kind: "race"``, ``docs/records.md``): the records finished races append to the
  record stream, exported with ``gpuhedge-celery records export``. Latency is ``e2e_ms`` (the
  race's creation to its winning result); a race without a winner failed. A race id seen twice
  (a race finished again after a crash, or its receipt rewritten after a late cancel) counts
  once, with its last record.
* **GPUHedge's live records**: requests are the kinds in :data:`GPUHEDGE_REQUEST_KINDS`.
  Latency is ``winner_total_ms`` (from the request's start), else ``winner_valid_at_ms``; no
  ``winner`` means the request failed. A ``validation_index`` line is joined with the latest
  full request line before it that has the same ``request_id`` (GPUHedge writes the engine's
  record, then its index row naming the arm; an arm run by the live-hedge engine writes its
  record with ``stage: live_hedge`` and its index row with ``stage: validation``), so a request
  counts once, in its arm, with the hedge flags of the engine's record. These records carry no
  cost: their $ are unknown. Every other kind is skipped and counted.

Statistics follow :mod:`.stats` (GPUHedge's conventions): a failed request has latency ``+inf``
(sorted last, always a deadline miss); each percentile is given nearest-rank and linear; the
miss rate has a Wilson 95 % interval.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .records import RECORD_KIND
from .stats import INF, linear_percentile, misses, nearest_rank, wilson_interval

GPUHEDGE_REQUEST_KINDS = frozenset(
    (
        "single_request",
        "hedged_request",
        "state_aware_request",
        "cascade_request",
        "validation_index",
    )
)
GPUHEDGE_HEDGE_FLAGS = ("hedge_launched", "cutover_fired", "safety_hedge_fired", "escalation_fired")
BY_CHOICES = ("policy", "provider", "budget-key", "arm")
QUANTILES = (50, 90, 95, 99)
NO_GROUP = "-"  # the group of requests without the key (no winner, no budget key, no arm)
OURS = "gpuhedge-celery"
GPUHEDGE = "gpuhedge"


class RecordError(ValueError):
    """A record that cannot be read; the message names where and what."""


@dataclass(slots=True)
class Request:
    """One request, whichever format it came from; costs and leaks are None when unknown."""

    latency_s: float  # +inf: no valid result
    policy: str
    provider: str | None  # the winner's provider
    budget_key: str | None
    arm: str | None
    hedged: bool
    active_usd: float | None
    billed_usd: float | None
    wasted_usd: float | None
    leaked: bool | None
    source: str


def _number(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{where}: {key!r} must be a number, got {value!r}")
    return float(value)


def _text(obj: Mapping[str, Any], key: str, where: str, required: bool = False) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise RecordError(f"{where}: a {obj.get('kind')!r} record without {key!r}")
        return None
    if not isinstance(value, str):
        raise RecordError(f"{where}: {key!r} must be a string, got {value!r}")
    return value


def _latency(winner: str | None, ms: float | None) -> float:
    return INF if winner is None or ms is None or math.isnan(ms) else ms / 1000.0


_NUMBERS = (int, float)  # bool is neither, by type()


def _check_ours(obj: Mapping[str, Any], where: str) -> None:
    """Raise the one-line error naming what is wrong with one of our records."""
    _text(obj, "race_id", where, required=True)
    _text(obj, "policy", where, required=True)
    for key in ("winner", "budget_key", "arm"):
        _text(obj, key, where)
    for key in ("e2e_ms", "usd", "billed_usd", "wasted_usd"):
        _number(obj, key, where)


def from_ours(obj: Mapping[str, Any], where: str) -> Request:
    """A request from one of our race records (``where``: ``FILE:LINE`` for errors)."""
    # The fast path checks types inline: a report reads 100,000 of these in well under a second.
    get = obj.get
    policy, winner, e2e = get("policy"), get("winner"), get("e2e_ms")
    budget_key, arm = get("budget_key"), get("arm")
    usd, billed, wasted = get("usd"), get("billed_usd"), get("wasted_usd")
    if not (
        type(policy) is str
        and type(get("race_id")) is str
        and (winner is None or type(winner) is str)
        and (budget_key is None or type(budget_key) is str)
        and (arm is None or type(arm) is str)
        and (e2e is None or type(e2e) in _NUMBERS)
        and (usd is None or type(usd) in _NUMBERS)
        and (billed is None or type(billed) in _NUMBERS)
        and (wasted is None or type(wasted) in _NUMBERS)
    ):
        _check_ours(obj, where)
    leaked = get("leaked")
    return Request(
        latency_s=INF if winner is None or e2e is None or e2e != e2e else e2e / 1000.0,
        policy=policy,  # type: ignore[arg-type]
        provider=winner,
        budget_key=budget_key,
        arm=arm,
        hedged=bool(get("hedged")),
        active_usd=usd,
        billed_usd=billed,
        wasted_usd=wasted,
        leaked=None if leaked is None else bool(leaked),
        source=OURS,
    )


def from_gpuhedge(obj: Mapping[str, Any], where: str) -> Request:
    """A request from one of GPUHedge's live records (already joined, for validation_index)."""
    winner = _text(obj, "winner", where)
    ms = _number(obj, "winner_total_ms", where)
    if ms is None:
        ms = _number(obj, "winner_valid_at_ms", where)
    leaked = None
    if "cancellation" in obj or "cancellations" in obj:
        found = list(obj.get("cancellations") or [])
        if isinstance(obj.get("cancellation"), Mapping):
            found.append(obj["cancellation"])
        leaked = any(bool(c.get("leaked")) for c in found if isinstance(c, Mapping))
    return Request(
        latency_s=_latency(winner, ms),
        policy=_text(obj, "policy", where) or NO_GROUP,
        provider=winner,
        budget_key=None,
        arm=_text(obj, "arm", where),
        hedged=any(bool(obj.get(flag)) for flag in GPUHEDGE_HEDGE_FLAGS),
        active_usd=None,
        billed_usd=None,
        wasted_usd=None,
        leaked=leaked,
        source=GPUHEDGE,
    )


def _joined(full: Mapping[str, Any], index: Mapping[str, Any]) -> dict[str, Any]:
    """An engine record and its index row as one request: the index row's fields (the arm),
    the engine's hedge flags wherever the engine recorded them."""
    merged = {**full, **index}
    for flag in GPUHEDGE_HEDGE_FLAGS:
        if full.get(flag) is not None:
            merged[flag] = full[flag]
    return merged


@dataclass
class RequestSet:
    """Requests read from any number of files, with what was skipped on the way."""

    ours: dict[str, Request] = field(default_factory=dict)  # by race id: the last record wins
    theirs: list[Request] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # kind -> lines that are not requests
    duplicates: int = 0  # our records replaced by a later one of the same race

    def add(self, objects: Iterable[tuple[str, Any]]) -> None:
        """Read one file's objects, each with its ``FILE:LINE`` (joins stay within a file)."""
        pending: dict[Any, tuple[str, Mapping[str, Any]]] = {}  # request id -> latest full
        for where, obj in objects:
            if not isinstance(obj, Mapping):
                raise RecordError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            kind = obj.get("kind")
            if kind == RECORD_KIND:
                request = from_ours(obj, where)
                race_id = obj["race_id"]
                self.duplicates += race_id in self.ours
                self.ours.pop(race_id, None)  # re-insert: the dict keeps the latest order
                self.ours[race_id] = request
            elif kind in GPUHEDGE_REQUEST_KINDS:
                key = obj.get("request_id")
                if kind != "validation_index":
                    if key is None:
                        self.theirs.append(from_gpuhedge(obj, where))
                        continue
                    earlier = pending.pop(key, None)
                    if earlier is not None:  # a second full record of one id: both count
                        self.theirs.append(from_gpuhedge(earlier[1], earlier[0]))
                    pending[key] = (where, obj)
                    continue
                full = pending.pop(key, None)
                self.theirs.append(from_gpuhedge(_joined(full[1], obj) if full else obj, where))
            else:
                self.skipped[str(kind)] += 1
        for where, obj in pending.values():
            self.theirs.append(from_gpuhedge(obj, where))

    def requests(self) -> list[Request]:
        return [*self.ours.values(), *self.theirs]


def group_key(request: Request, by: str) -> str:
    """The group ``request`` belongs to under ``--by by``."""
    value: str | None
    if by == "policy":
        value = request.policy
    elif by == "provider":
        value = request.provider
    elif by == "budget-key":
        value = request.budget_key
    elif by == "arm":
        value = request.arm
    else:
        raise ValueError(f"unknown grouping {by!r}; expected one of {', '.join(BY_CHOICES)}")
    return value if value else NO_GROUP


def grouped(requests: Iterable[Request], by: str) -> dict[str, list[Request]]:
    """Requests by group, groups sorted by name (the no-key group last)."""
    groups: dict[str, list[Request]] = {}
    for r in requests:
        groups.setdefault(group_key(r, by), []).append(r)
    return dict(sorted(groups.items(), key=lambda kv: (kv[0] == NO_GROUP, kv[0])))


def _mean_if_all(values: Sequence[float | None]) -> float | None:
    """The mean, or None (n/a) unless every request knows the value."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


def summarise_group(
    name: str, requests: Sequence[Request], deadlines: Sequence[float]
) -> dict[str, Any]:
    """One group's row: n, percentiles (nearest-rank and linear), misses with Wilson 95 %
    intervals per deadline, hedge rate, $ per request (active, billed), wasted $, leaks."""
    n = len(requests)
    if n == 0:
        raise ValueError(f"group {name!r} has no requests")
    latencies = sorted(r.latency_s for r in requests)
    row: dict[str, Any] = {"group": name, "n": n, "failed": sum(math.isinf(v) for v in latencies)}
    for q in QUANTILES:
        row[f"p{q}_s"] = nearest_rank(latencies, q / 100)
        row[f"p{q}_linear_s"] = linear_percentile(latencies, q / 100)
    row["misses"], row["miss_rate"], row["miss_ci"] = {}, {}, {}
    for d in deadlines:
        k = misses(latencies, d)
        label = format(d, "g")
        row["misses"][label] = k
        row["miss_rate"][label] = k / n
        row["miss_ci"][label] = list(wilson_interval(k, n))
    hedged = sum(1 for r in requests if r.hedged)
    row["hedged"] = hedged
    row["hedge_rate"] = hedged / n
    row["active_usd_per_request"] = _mean_if_all([r.active_usd for r in requests])
    row["billed_usd_per_request"] = _mean_if_all([r.billed_usd for r in requests])
    wasted = [r.wasted_usd for r in requests]
    row["wasted_usd"] = None if any(w is None for w in wasted) else sum(wasted)
    known = [r.leaked for r in requests if r.leaked is not None]
    row["leaks"] = sum(1 for x in known if x) if known else None
    return row


def summarise(
    requests: Sequence[Request], by: str = "policy", deadlines: Sequence[float] = (60.0,)
) -> list[dict[str, Any]]:
    """Every group's row (see :func:`summarise_group`)."""
    return [summarise_group(name, rs, deadlines) for name, rs in grouped(requests, by).items()]
