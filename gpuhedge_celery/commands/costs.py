"""``gpuhedge-celery costs [--since DAY] [--json]``: each provider's own bill beside our ledger.

For every provider of the config, the adapter's ``reported_spend(since)`` asks the provider's
billing (Modal: the workspace billing report, whole UTC days; RunPod, through the ``runpod``
adapter: the drop of the account's balance between two runs' snapshots, balance-derived;
Cerebrium and the generic ``http`` adapter: none, "unavailable"), and the
ledger's settled spend for the same provider over the same UTC days is put beside it with the
difference (provider minus ledger). Each comparison with a provider figure is appended to the
ledger as a ``reconcile`` record (``--no-record``: only print). Secrets never appear.
Exit codes: 0, 2 a bad ``--since`` or config, 3 Redis unreachable.
"""

from __future__ import annotations

import json
import time
from datetime import date, datetime, timedelta, timezone
from typing import Any

import click

from ..core.budget import to_nano, to_usd, utc_day
from ..errors import ConfigError
from ..providers.account import AVAILABLE, UNAVAILABLE, SpendReport

DAY_S = 86400


def _since(text: str | None) -> float:
    """``--since`` (a UTC day, ``YYYY-MM-DD``) as epoch seconds; default: seven days ago."""
    if not text:
        today = datetime.now(timezone.utc).date()
        return _epoch(today - timedelta(days=7))
    try:
        return _epoch(date.fromisoformat(text.strip()))
    except ValueError:
        raise ConfigError(f"expected a UTC day YYYY-MM-DD, got {text!r}", key="--since") from None


def _epoch(day: date) -> float:
    return datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp()


def days_between(start: float, until: float | None, now: float | None = None) -> list[str]:
    """The UTC days from ``start``'s day up to ``until`` (exclusive), or through today (a report
    with no end covers up to now: today so far, never tomorrow)."""
    end = until if until is not None else (time.time() if now is None else now)
    days, t = [], float(int(start // DAY_S) * DAY_S)
    while t < end - 1e-6:
        days.append(utc_day(t))
        t += DAY_S
    return days


def compare(ledger: Any, name: str, report: SpendReport, since: float) -> dict[str, Any]:
    """One provider's row: the ledger's settled spend over the report's days, and the gap."""
    start = report.since if report.since is not None else since
    days = days_between(start, report.until)
    counters = ledger.counters([f"d:{d}:p:{name}" for d in days])
    spent = sum(s for _, s in counters.values())
    reported = to_nano(report.usd) if report.usd is not None else None
    return {
        "provider": name,
        "status": report.status,
        "from": days[0] if days else None,
        "through": days[-1] if days else None,
        "ledger_usd": to_usd(spent),
        "reported_usd": report.usd,
        "difference_usd": None if reported is None else to_usd(reported - spent),
        "detail": report.detail,
        "_nano": (spent, reported),
    }


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.4f}"


@click.command(name="costs")
@click.option("--since", default=None, help="First UTC day (YYYY-MM-DD) [default: 7 days ago].")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@click.option("--no-record", is_flag=True, help="Do not append reconciliation records.")
def command(since: str | None, as_json: bool, no_record: bool) -> None:
    """The spend each provider reports, beside the ledger's, and the difference."""
    from ..cli import cli_redis_client, root_config, root_settings
    from ..store.budget import BudgetStore
    from ._accounts import build_for_command, one_line, secrets_of

    start = _since(since)
    cfg = root_config()
    secrets = secrets_of(cfg)
    ledger = BudgetStore(cli_redis_client(), root_settings().prefix)
    rows = []
    for name in cfg.providers:
        try:
            report = build_for_command(cfg, name).reported_spend(start)
        except Exception as e:  # a missing ${VAR}, an adapter bug: one row, never a traceback
            report = SpendReport(name, UNAVAILABLE, None, start, detail=f"{type(e).__name__}: {e}")
        row = compare(ledger, name, report, start)
        row["detail"] = one_line(row["detail"], secrets)
        spent, reported = row.pop("_nano")
        if report.status == AVAILABLE and reported is not None and not no_record:
            row["record"] = ledger.add_reconciliation(
                {
                    "provider": name,
                    "from": row["from"],
                    "through": row["through"],
                    "ledger_nano": spent,
                    "reported_nano": reported,
                    "diff_nano": reported - spent,
                    "detail": row["detail"],
                }
            )
        rows.append(row)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max([len(r["provider"]) for r in rows] + [8])
    click.echo(
        f"{'provider':<{width}}  {'days':<23}  {'ledger':>11}  {'reported':>11}  "
        f"{'difference':>11}  detail"
    )
    for r in rows:
        days = f"{r['from']}..{r['through']}" if r["from"] else "-"
        click.echo(
            f"{r['provider']:<{width}}  {days:<23}  {_usd(r['ledger_usd']):>11}  "
            f"{_usd(r['reported_usd']):>11}  {_usd(r['difference_usd']):>11}  {r['detail']}"
        )
