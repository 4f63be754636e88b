"""Money against the providers' truth in tests: the comparison lives in the package
(``gpuhedge_celery/bench/money_truth.py``, which ``bench races --rows truth`` runs too); this
module gathers both sides for a race cluster on the loopback fakes and compares them."""

from __future__ import annotations

from typing import Any

from gpuhedge_celery.bench.money_truth import (
    agree,
    compare,
    gather,
    merge_truth,
    rates_from_config,
    receipt_attempt_cost,
    truth_cost,
)

__all__ = [
    "agree",
    "compare",
    "compare_cluster",
    "gather",
    "merge_truth",
    "rates_from_config",
    "receipt_attempt_cost",
    "truth_cost",
]


def compare_cluster(rc: Any, race_ids: list[str], fakes: dict[str, Any]) -> dict[str, Any]:
    """:func:`compare` for ``rc`` (a ``RaceCluster``): ``fakes`` maps each provider name to the
    fake process serving it (one fake per provider)."""
    truth = merge_truth(**{name: fake.truth() for name, fake in fakes.items()})
    found = gather(rc.client, rc.prefix, race_ids)
    return compare(
        truth,
        rates_from_config(rc.config),
        found["receipts"],
        found["records"],
        found["ledger"],
        found["open_reservations"],
    )
