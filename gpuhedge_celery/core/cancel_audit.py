"""The cancel audit's records and its matrix: the evidence behind each adapter's cancel claim.

``gpuhedge-celery cancel-audit`` submits jobs and cancels them on purpose, ``early`` (soon
after the submit, usually while queued) and ``late`` (once the job runs), through each
provider's own adapter. Each cancel is one ``forced_cancel`` record; the matrix counts, per
provider and phase, the attempts, how many cancels were confirmed terminal by an observed
state, how many leaked, and how many jobs were already running when the cancel was sent. The
record and summary shapes are GPUHedge's (``kind: forced_cancel`` / ``cancel_audit_summary``),
so both tools' audits read alike. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

PHASES = ("early", "late")
COLUMNS = ("attempts", "terminal", "leaked", "was_running")


def forced_cancel_record(
    provider: str,
    phase: str,
    attempt: int,
    *,
    cancel_at_s: float,
    state_before: str,
    receipt: Mapping[str, Any],
    ts: float,
) -> dict[str, Any]:
    """One forced cancel as a JSON line (``receipt``: the adapter's ``CancelReceipt.to_dict``)."""
    return {
        "kind": "forced_cancel",
        "provider": provider,
        "phase": phase,
        "attempt": attempt,
        "cancel_at_s": round(cancel_at_s, 3),
        "state_before_cancel": state_before,
        "receipt": dict(receipt),
        "ts": datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(),
    }


def tally(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, int]]]:
    """``{provider: {phase: {attempts, terminal, leaked, was_running}}}`` over the records.

    ``terminal``: the cancel was confirmed by an observed terminal state; ``leaked``: the
    receipt says the job may still run (no confirmation); ``was_running``: the receipt says
    the job was running when the cancel was sent (``None``, unknown, is not counted).
    """
    matrix: dict[str, dict[str, dict[str, int]]] = {}
    for r in records:
        if r.get("kind") != "forced_cancel":
            continue
        receipt = r.get("receipt") or {}
        cell = matrix.setdefault(r["provider"], {}).setdefault(
            r["phase"], dict.fromkeys(COLUMNS, 0)
        )
        cell["attempts"] += 1
        cell["terminal"] += bool(
            receipt.get("confirmed_terminal") or receipt.get("evidence") == "confirmed_terminal"
        )
        cell["leaked"] += bool(receipt.get("leaked"))
        cell["was_running"] += receipt.get("was_running") is True
    return matrix


def summary_record(matrix: Mapping[str, Any], projected_usd: float, ts: float) -> dict[str, Any]:
    """The audit's closing line: its matrix and projected spend."""
    return {
        "kind": "cancel_audit_summary",
        "matrix": {p: dict(phases) for p, phases in matrix.items()},
        "projected_spend_usd": round(projected_usd, 6),
        "ts": datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(),
    }


def format_matrix(
    matrix: Mapping[str, Mapping[str, Mapping[str, int]]], providers: Sequence[str]
) -> list[str]:
    """The matrix as a text table, one line per provider and phase."""
    width = max([8, *(len(p) for p in providers)])
    lines = [f"{'provider':<{width}} {'phase':<6} " + " ".join(f"{c:>11}" for c in COLUMNS)]
    for p in providers:
        for phase in PHASES:
            cell = (matrix.get(p) or {}).get(phase)
            if cell is None:
                continue
            counts = " ".join(f"{cell[c]:>11}" for c in COLUMNS)
            lines.append(f"{p:<{width}} {phase:<6} {counts}")
    return lines
