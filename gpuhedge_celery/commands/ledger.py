"""``gpuhedge-celery ledger export [--since WHEN] [--output FILE]``: the budget ledger as JSONL;
``ledger repair [--apply]``: the counters recomputed from it.

One JSON object per line, oldest first: every reservation (``reserve``), refusal (``refuse``),
settlement (``settle``) and reconciliation (``reconcile``), with its ``stream_id``, its UTC time,
the ``reservation`` it is about (``RACE/ATTEMPT``),
and amounts both in integer nano-dollars (``nano``, exact: the counters add these up) and in
USD (``usd``). ``--since`` takes an ISO date or time (UTC unless it names a zone), epoch
seconds, or a stream id; ``-`` (the default) is the beginning. Exit codes: 0, 2 a bad
``--since``, 3 Redis unreachable.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime, timezone
from typing import Any

import click

from ..core.budget import to_usd
from ..errors import ConfigError

_STREAM_ID = re.compile(r"^\d+-\d+\Z")


def since_to_stream_id(since: str) -> str:
    """``--since`` as the first stream id to export (a bad value: a one-line usage error)."""
    text = since.strip()
    if text in ("", "-"):
        return "-"
    if _STREAM_ID.match(text):
        return text
    try:
        return f"{int(float(text) * 1000)}-0"
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(
            f"expected an ISO date or time, epoch seconds or a stream id, got {since!r}",
            key="--since",
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return f"{int(when.timestamp() * 1000)}-0"


def entry_json(entry_id: str, fields: dict[str, str]) -> dict[str, Any]:
    """One ledger entry as exported: typed numbers, USD beside nano-dollars."""
    ms = int(entry_id.split("-", 1)[0])
    out: dict[str, Any] = {
        "stream_id": entry_id,
        "at": datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds"),
    }
    for key, value in fields.items():
        if key == "id":
            out["reservation"] = value  # race/attempt: one per attempt
        elif key.endswith("nano") or key in ("at_ms", "cap_index"):
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = value
            if key.endswith("nano"):
                name = "usd" if key == "nano" else key[: -len("nano")] + "usd"
                out[name] = to_usd(out[key]) if isinstance(out[key], int) else None
        else:
            out[key] = value
    return out


@click.group(name="ledger")
def command() -> None:
    """The budget ledger: reservations, settlements and reconciliations (docs/costs.md)."""


@command.command(name="export")
@click.option(
    "--since",
    default="-",
    show_default=True,
    help="From this UTC date/time, epoch seconds or stream id.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write to FILE instead of standard output.",
)
def export(since: str, output: str | None) -> None:
    """Write the ledger as JSONL, oldest first."""
    from ..cli import cli_redis_client, root_settings
    from ..store.budget import BudgetStore

    start = since_to_stream_id(since)
    ledger = BudgetStore(cli_redis_client(), root_settings().prefix)
    out = open(output, "w", encoding="utf-8") if output else sys.stdout  # noqa: SIM115
    count = 0
    try:
        for entry_id, fields in ledger.entries(start):
            out.write(json.dumps(entry_json(entry_id, fields), sort_keys=True) + "\n")
            count += 1
    finally:
        if output:
            out.close()
    if output:
        click.echo(f"{count} ledger entries written to {output}", err=True)


@command.command(name="repair")
@click.option(
    "--apply",
    "apply",
    is_flag=True,
    help="Replace the counters by the ledger's figures (else only compare).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the differences as JSON.")
def repair(apply: bool, as_json: bool) -> None:
    """Recompute the budget counters from the ledger stream and compare them with Redis's.

    Every counter change is appended to the ledger by the script that makes it, so the stream
    replayed is the truth; a difference means a write was lost or made by hand. Exit codes: 0
    the counters agree (or were repaired with --apply), 1 they differ, 3 Redis unreachable.
    """
    from ..cli import EXIT_FAILED, cli_redis_client, root_settings
    from ..store.budget import BudgetStore

    ledger = BudgetStore(cli_redis_client(), root_settings().prefix)
    diff = ledger.repair(apply=apply)
    if as_json:
        click.echo(json.dumps({"differences": diff, "applied": apply and bool(diff)}, indent=2))
    elif not diff:
        click.echo("ok: every budget counter agrees with the ledger")
    else:
        verb = "repaired" if apply else "differ (run with --apply to repair)"
        click.echo(f"{len(diff)} budget counter(s) {verb}:")
        for name, (found, expected) in diff.items():
            if name.startswith("o|"):  # a count of over-reported settlements, not money
                click.echo(f"  {name:<40} redis {found:,}  ledger {expected:,}")
                continue
            click.echo(f"  {name:<40} redis ${to_usd(found):,.9f}  ledger ${to_usd(expected):,.9f}")
    if diff and not apply:
        raise click.exceptions.Exit(EXIT_FAILED)
