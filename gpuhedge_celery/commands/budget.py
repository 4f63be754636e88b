"""``gpuhedge-celery budget [--json]``: every cap, what is reserved and spent against it, headroom.

Read from the ledger's counters in Redis (``store/budget.py``) and the caps of the config this
installation uses. Rows: the UTC day, the lifetime ceiling, each provider and each budget key
(day and lifetime), and the per-request cap (a limit on each race's own attempts together).
Exit codes: 0, 2 a bad config, 3 Redis unreachable.
"""

from __future__ import annotations

import json
from typing import Any

import click

from ..core.budget import utc_day
from ..store.budget import budget_report

__all__ = ["budget_report", "command", "render"]


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.4f}"


def render(report: dict[str, Any]) -> str:
    lines = []
    if not report["enabled"]:
        lines.append("budgets are off: no cap in the config's budget block (docs/costs.md)")
    per_request = report["max_usd_per_request"]
    lines.append(
        f"per request: {_usd(per_request)} (each race's attempts together, worst cases reserved)"
    )
    if report.get("default_key"):
        unknown = "charged to it too" if report.get("unknown_keys") == "default" else "refused"
        lines.append(
            f"default key: {report['default_key']} (a request naming no key is charged "
            f"to it; an unlisted key is {unknown})"
        )
    header = f"{'scope':<32} {'cap':>12} {'reserved':>12} {'spent':>12} {'headroom':>12}"
    lines += ["", header, "-" * len(header)]
    for r in report["rows"]:
        lines.append(
            f"{r['what']:<32} {_usd(r['cap_usd']):>12} {_usd(r['reserved_usd']):>12} "
            f"{_usd(r['spent_usd']):>12} {_usd(r['headroom_usd']):>12}"
        )
    lines += ["", f"open reservations: {report['open_reservations']}"]
    return "\n".join(lines)


@click.command(name="budget")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def command(as_json: bool) -> None:
    """Caps, reserved, spent and headroom, from the budget ledger in Redis (docs/costs.md)."""
    from ..cli import cli_redis_client, root_config, root_settings
    from ..store.budget import BudgetStore

    cfg = root_config()
    ledger = BudgetStore(cli_redis_client(), root_settings().prefix)
    report = budget_report(ledger, cfg.budget, list(cfg.providers), utc_day())
    click.echo(json.dumps(report, indent=2) if as_json else render(report))
