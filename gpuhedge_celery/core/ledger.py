"""The budget counters as the ledger stream says they should be (pure).

Every change to a counter is appended to the ledger stream by the same script that makes it,
so replaying the stream rebuilds every counter. ``ledger repair`` compares that with the
counters in Redis: a difference means a write was lost or made outside the scripts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .budget import scopes


def counters_from_ledger(entries: Iterable[Mapping[str, str]]) -> dict[str, int]:
    """``r|<scope>`` (reserved) and ``s|<scope>`` (spent) nano-dollars, replayed from ledger
    entries oldest first: a ``reserve`` adds its amount to every scope's reserved counter, a
    ``settle`` moves its reservation out of reserved and its cost into spent (and one capped at
    its reservation counts in ``o|<provider>``), an ``adjust`` (a late result's price) moves
    spent by its difference. Refusals and reconciliations change no counter."""
    totals: dict[str, int] = {}

    def add(field: str, nano: int) -> None:
        totals[field] = totals.get(field, 0) + nano

    for entry in entries:
        kind = entry.get("type")
        if kind not in ("reserve", "settle", "adjust"):
            continue
        charged = scopes(entry.get("day", ""), entry.get("provider", ""), entry.get("key") or None)
        for scope in charged:
            if kind == "reserve":
                add(f"r|{scope}", int(entry["nano"]))
            elif kind == "adjust":
                add(f"s|{scope}", int(entry["nano"]))
            else:
                add(f"r|{scope}", -int(entry["reserved_nano"]))
                add(f"s|{scope}", int(entry["nano"]))
        if kind in ("settle", "adjust") and entry.get("over_reported") == "1":
            add(f"o|{entry.get('provider', '')}", 1)
    return totals


def differences(found: Mapping[str, int], expected: Mapping[str, int]) -> dict[str, list[int]]:
    """Counter -> [in Redis, from the ledger] for every counter where the two differ."""
    return {
        field: [found.get(field, 0), expected.get(field, 0)]
        for field in sorted(set(found) | set(expected))
        if found.get(field, 0) != expected.get(field, 0)
    }
