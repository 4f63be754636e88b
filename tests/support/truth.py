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
    "product_failures",
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


# Per-attempt disagreements that are the product's own (receipt, record and ledger apart), not
# the product against the fakes' truth.
PRODUCT_SPLITS = (
    "receipt billed != record billed",
    "receipt billed != ledger settled",
    "record billed != ledger settled",
    "no record",
    "no ledger settlement",
    "job unknown to the fake",
)


def product_failures(report: dict[str, Any]) -> list[str]:
    """What a :func:`compare` report shows wrong whatever the provider's truth: receipt, record
    and ledger disagreeing about an attempt, and receipts claiming a refused cancel was
    acknowledged."""
    failures = []
    split = {
        k: v
        for k, v in report["disagreement_counts"].items()
        if k in PRODUCT_SPLITS or k.startswith("settled ")
    }
    if split:
        failures.append(f"receipt/record/ledger disagree per attempt: {split}")
    lying = [x for x in report["provider_ack_but_refused"] if not x["cancel_accepted_later"]]
    if lying:
        failures.append(f"{len(lying)} receipts say provider_ack for a cancel never accepted")
    return failures
