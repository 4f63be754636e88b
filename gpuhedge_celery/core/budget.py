"""Budget rules, pure: caps, an attempt's worst-case cost, which caps apply, the UTC day.

Money is counted in integer nano-dollars (1e-9 USD) wherever it is added up, so a ledger that
sums thousands of reservations and settlements stays exact (Redis ``HINCRBY`` is integer). A
reservation rounds up (it is a bound), a settlement rounds to the nearest nano-dollar.

Every reservation charges a set of *scopes* (counters): the lifetime total, the UTC day, the
provider (lifetime and day) and, when ``budget.keys`` is set, the budget key (lifetime and day):
the caller's key when it is listed, ``default_key`` when the caller names none (or, with
``unknown_keys: default``, one that is not listed); any other key is refused before the race.
A cap is a limit on one scope's reserved + spent nano-dollars; :func:`limits` lists them for one
attempt. The per-request cap is a limit on the race's own counter (its attempts together).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NANO = 1_000_000_000  # nano-dollars per dollar
ANY_KEY = "*"  # refused as a budget.keys entry: it gave every unlisted key a fresh cap
UNKNOWN_KEYS = ("refuse", "default")  # budget.unknown_keys: what a key not listed gets
KEY_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,100}\Z")


def to_nano(usd: float, *, round_up: bool = False) -> int:
    """USD as integer nano-dollars (``round_up`` for bounds such as reservations)."""
    scaled = float(usd) * NANO
    return int(math.ceil(scaled - 1e-6)) if round_up else int(round(scaled))


def to_usd(nano: int | float) -> float:
    """Nano-dollars as USD (rounded to the nano-dollar, so sums print cleanly)."""
    return round(float(nano) / NANO, 9)


def utc_day(epoch_s: float | None = None) -> str:
    """The UTC calendar day of ``epoch_s`` (now by default) as ``YYYY-MM-DD``: the day bucket."""
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() if epoch_s is None else epoch_s))


@dataclass(frozen=True)
class ScopeCap:
    """Caps on one provider's or one budget key's spend: per UTC day and over the ledger's life."""

    max_usd_per_day: float | None = None
    max_usd_total: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"max_usd_per_day": self.max_usd_per_day, "max_usd_total": self.max_usd_total}


@dataclass(frozen=True)
class BudgetCaps:
    """The ``budget:`` block: every cap is optional; none set means budgets are off."""

    max_usd_per_request: float | None = None
    max_usd_per_day: float | None = None
    ceiling_usd: float | None = None
    providers: Mapping[str, ScopeCap] = field(default_factory=dict)
    keys: Mapping[str, ScopeCap] = field(default_factory=dict)
    default_key: str | None = None  # charged when the caller names no key (required with keys)
    unknown_keys: str = "refuse"  # "default": a key not listed is charged to default_key

    @property
    def enabled(self) -> bool:
        """Whether any cap is set (then every submit reserves, and the ledger records it)."""
        scoped = [c for c in (*self.providers.values(), *self.keys.values())]
        return any(
            v is not None
            for v in (self.max_usd_per_request, self.max_usd_per_day, self.ceiling_usd)
        ) or any(c.max_usd_per_day is not None or c.max_usd_total is not None for c in scoped)

    def key_cap(self, key: str | None) -> ScopeCap | None:
        """The caps of budget key ``key`` (its own entry), or None."""
        if key is None:
            return None
        return self.keys.get(key)

    def key_problem(self, key: Any) -> str | None:
        """Why ``key`` cannot be used as a budget key, or None when it can."""
        if key is None:
            return None
        if not isinstance(key, str) or not KEY_RE.match(key) or key == ANY_KEY:
            return f"expected 1-100 letters, digits, '_', '-', '.' or ':', got {key!r}"
        if self.keys and key not in self.keys and self.unknown_keys != "default":
            known = ", ".join(sorted(self.keys))
            return f"no budget for key {key!r} in budget.keys (known: {known})"
        return None

    def charged_key(self, key: str | None) -> str | None:
        """The key a race asking for ``key`` is charged to (``key_problem`` must be None): the
        key itself when listed, else ``default_key`` (the caller named none, or an unlisted
        key under ``unknown_keys: default``); without ``budget.keys``, ``key`` as given (a
        label: nothing caps by key then)."""
        if not self.keys:
            return key
        if key is not None and key in self.keys:
            return key
        return self.default_key

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_usd_per_request": self.max_usd_per_request,
            "max_usd_per_day": self.max_usd_per_day,
            "ceiling_usd": self.ceiling_usd,
            "providers": {k: v.to_dict() for k, v in self.providers.items()},
            "keys": {k: v.to_dict() for k, v in self.keys.items()},
            "default_key": self.default_key,
            "unknown_keys": self.unknown_keys,
        }


def worst_case_usd(cap_s: float, rate_per_s: float, idle_s: float) -> float:
    """The most one attempt can cost: billed to its cap, plus one worker start's idle window.

    ``cap_s`` is the attempt's cap (the race stops waiting and cancels the job then),
    ``rate_per_s`` the provider's billed rate and ``idle_s`` the seconds it bills per worker
    start after the job (all in the same time unit).
    """
    return max(0.0, cap_s) * max(0.0, rate_per_s) + max(0.0, idle_s) * max(0.0, rate_per_s)


@dataclass(frozen=True)
class PlannedAttempt:
    """One attempt a policy can launch, as its reservation sees it: provider, role, the
    attempt's cap and the provider's rate and idle window (one time unit throughout)."""

    provider: str
    role: str
    cap_s: float
    rate_per_s: float
    idle_s: float

    @property
    def worst_case_usd(self) -> float:
        return worst_case_usd(self.cap_s, self.rate_per_s, self.idle_s)

    def arithmetic(self) -> str:
        """``primary runpod 180 s x $0.000306/s + 60 s idle x $0.000306/s = $0.0734``."""
        return (
            f"{self.role} {self.provider} {self.cap_s:g} s x ${self.rate_per_s:g}/s + "
            f"{self.idle_s:g} s idle x ${self.rate_per_s:g}/s = ${self.worst_case_usd:.4f}"
        )


@dataclass(frozen=True)
class CapConflict:
    """A cap that refuses ``attempt`` in a race whose earlier attempts (``before``, those the
    same cap counts) are still reserved at their worst cases: the policy can launch it, the
    budget never lets it run."""

    cap: str
    limit_usd: float
    before: tuple[PlannedAttempt, ...]
    attempt: PlannedAttempt

    @property
    def total_usd(self) -> float:
        return sum(a.worst_case_usd for a in (*self.before, self.attempt))

    def text(self) -> str:
        """One line: the cap, the attempt it forbids and the arithmetic."""
        a = self.attempt
        parts = ", ".join(b.arithmetic() for b in (*self.before, a))
        head = f"budget.{self.cap} ${self.limit_usd:g} forbids the {a.role} attempt ({a.provider})"
        if not self.before:
            return f"{head}: {parts} > ${self.limit_usd:g}; it is refused every time"
        return (
            f"{head}: {parts}; together ${self.total_usd:.4f} > ${self.limit_usd:g}; it is "
            "refused whenever the attempts before it still hold their reservations"
        )


def cap_conflicts(caps: BudgetCaps, attempts: list[PlannedAttempt]) -> list[CapConflict]:
    """Every cap that refuses an attempt the policy can launch, on an empty ledger.

    ``attempts`` in launch order (primary first). Each cap counts the attempts it applies to
    (per request, day and ceiling: all; ``providers.P``: P's; ``keys.K``: all of a request
    with key K) with every earlier admitted one still reserved at its worst case, as in the
    worst race; a refused attempt holds nothing, so a later one may still fit. Amounts are
    compared in nano-dollars, rounded up, as the reserve script compares them.
    """
    counted: dict[str, tuple[float, list[PlannedAttempt]]] = {}
    for key in (None, *caps.keys):
        for a in attempts:
            for name, usd in _slot_caps(caps, a.provider, key):
                if usd is None or (key is not None and not name.startswith("keys.")):
                    continue
                counted.setdefault(name, (usd, []))[1].append(a)
    found: list[CapConflict] = []
    for name, (usd, applies) in counted.items():
        used, admitted = 0, list[PlannedAttempt]()
        for a in applies:
            amount = to_nano(a.worst_case_usd, round_up=True)
            if used + amount > to_nano(usd):
                found.append(CapConflict(name, usd, tuple(admitted), a))
                continue
            used += amount
            admitted.append(a)
    return found


@dataclass(frozen=True)
class Limit:
    """One cap that applies to an attempt: a counter (``scope``) and its limit in nano-dollars.

    ``scope`` is ``request`` (the race's own counter) or a counter name (see :func:`scopes`).
    ``name`` says which cap it is, for refusals and reports.
    """

    name: str
    scope: str
    limit_nano: int


def scopes(day: str, provider: str, key: str | None) -> list[str]:
    """The counters one reservation charges, in slot order: lifetime, day, provider,
    provider-day, and with a budget key, key and key-day. ``budget_reserve.lua`` builds the
    same names from the day, provider and key it is given."""
    found = ["all", f"d:{day}", f"p:{provider}", f"d:{day}:p:{provider}"]
    if key is not None:
        found += [f"k:{key}", f"d:{day}:k:{key}"]
    return found


def _slot_caps(caps: BudgetCaps, provider: str, key: str | None) -> list[tuple[str, float | None]]:
    """(cap name, USD or None) per slot: the request, then each scope of :func:`scopes`."""
    own = caps.providers.get(provider)
    slots: list[tuple[str, float | None]] = [
        ("max_usd_per_request", caps.max_usd_per_request),
        ("ceiling_usd", caps.ceiling_usd),
        ("max_usd_per_day", caps.max_usd_per_day),
        (f"providers.{provider}.max_usd_total", own.max_usd_total if own else None),
        (f"providers.{provider}.max_usd_per_day", own.max_usd_per_day if own else None),
    ]
    if key is not None:
        cap = caps.key_cap(key)
        slots += [
            (f"keys.{key}.max_usd_total", cap.max_usd_total if cap else None),
            (f"keys.{key}.max_usd_per_day", cap.max_usd_per_day if cap else None),
        ]
    return slots


def cap_slots(caps: BudgetCaps, provider: str, key: str | None) -> list[int]:
    """Each slot's cap in nano-dollars, -1 where none applies (what the reserve script takes)."""
    return [-1 if usd is None else to_nano(usd) for _, usd in _slot_caps(caps, provider, key)]


def cap_name(caps: BudgetCaps, provider: str, key: str | None, slot: int) -> str:
    """The name of the cap in ``slot`` (0: per request, i: the i-th scope), for refusals."""
    slots = _slot_caps(caps, provider, key)
    return slots[slot][0] if 0 <= slot < len(slots) else f"cap {slot}"


def limits(caps: BudgetCaps, day: str, provider: str, key: str | None) -> list[Limit]:
    """Every cap that applies to one attempt of ``provider`` for budget key ``key`` on ``day``."""
    names = ["request", *scopes(day, provider, key)]
    return [
        Limit(name, names[i], to_nano(usd))
        for i, (name, usd) in enumerate(_slot_caps(caps, provider, key))
        if usd is not None
    ]


def refusal_text(cap: str, limit_nano: int, used_nano: int, amount_nano: int) -> str:
    """The one line a refused attempt carries (its receipt's reason)."""
    return (
        f"budget: refused by {cap}: ${to_usd(limit_nano):g} cap, ${to_usd(used_nano):g} "
        f"reserved or spent, this attempt's worst case ${to_usd(amount_nano):g}"
    )


REFUSED_PREFIX = "budget: refused"

CAP_KINDS = ("request", "ceiling", "day", "provider", "key", "settled", "other")


def cap_kind(cap: str) -> str:
    """Which kind of cap ``cap`` (a name from :func:`cap_name`) is, as one of
    :data:`CAP_KINDS` (a metric's label: never a provider or key name). ``settled`` is the
    refusal of an attempt whose reservation was settled already (a redelivered submit)."""
    if cap == "max_usd_per_request":
        return "request"
    if cap == "ceiling_usd":
        return "ceiling"
    if cap == "max_usd_per_day":
        return "day"
    if cap.startswith("providers."):
        return "provider"
    if cap.startswith("keys."):
        return "key"
    return "settled" if cap == "settled" else "other"
