"""Reading one race's budget ledger in tests: its reservations, and proof none is left open.

Used by the races on the providers' loopback fakes (tests/test_runpod_races.py,
tests/test_modal_races.py), whose clusters run with a ``budget:`` block.
"""

from __future__ import annotations

from typing import Any

from gpuhedge_celery.store.budget import BudgetStore
from gpuhedge_celery.store.race_keys import reservation_id


def settled_reservations(
    budget: BudgetStore, receipt: dict[str, Any], reserved: list[str]
) -> dict[str, dict[str, str]]:
    """The reservation record of each attempt of ``reserved`` (attempt ids), after checking
    that every one settled, that none is still indexed as open, that the race's counter holds
    only what they cost, and that the ledger has exactly one settlement of each; the race's
    other attempts must hold no reservation at all."""
    race_id = receipt["race_id"]
    records = {}
    for a in receipt["attempts"]:
        record = budget.reservation(race_id, a["id"])
        if a["id"] not in reserved:
            assert record is None, (a["id"], record)
            continue
        assert record is not None, f"attempt {a['id']} reserved nothing"
        assert "settled" in record and record.get("source"), (a["id"], record)
        assert budget.client.zscore(budget.keys.open, reservation_id(race_id, a["id"])) is None
        records[a["id"]] = record
    assert sorted(records) == sorted(reserved)
    costs = sum(int(r["settled"]) for r in records.values())
    assert int(budget.client.get(budget.keys.request(race_id)) or 0) == costs
    settles = [e for _, e in budget.entries() if e["type"] == "settle" and e["race"] == race_id]
    assert sorted(e["attempt"] for e in settles) == sorted(reserved)
    for e in settles:
        assert int(e["nano"]) == int(records[e["attempt"]]["settled"])
        assert e["source"] == records[e["attempt"]]["source"]
    return records


__all__ = ["settled_reservations"]
