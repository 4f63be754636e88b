"""``gpuhedge-celery receipt RACE_ID [--json]``: a race's full audit, read from Redis by race id.

The race id is the ``hedged_infer`` task id. A finished race shows its stored receipt (kept
``GPUHEDGE_RECEIPT_TTL_S``); a race still in flight shows a provisional one (``finished``
false). Exit codes: 0 found, 1 no such race (unknown or expired), 2 a malformed id, 3 Redis
unreachable.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import click

from ..errors import ConfigError, GpuHedgeError


def _store() -> Any:
    """A race store for the CLI (fails fast when Redis is down)."""
    from ..cli import cli_redis_client, root_settings
    from ..store.races import RaceStore

    return RaceStore(cli_redis_client(), root_settings().prefix)


def _when(epoch_s: float | None) -> str:
    if not epoch_s:
        return "-"
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).isoformat(timespec="milliseconds")


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:.6f}"


def render(receipt: dict[str, Any]) -> str:
    """The receipt as a short human-readable report."""
    lat = receipt.get("latency_ms")
    flags = [f for f in ("hedged", "cut_over", "escalated", "leaked") if receipt.get(f)]
    lines = [
        f"race      {receipt['race_id']}" + ("" if receipt.get("finished") else "  (in flight)"),
        f"policy    {receipt.get('policy')}",
        f"winner    {receipt.get('winner_provider') or 'none'}"
        + (f" ({receipt['winner']})" if receipt.get("winner") else f": {receipt.get('note')}"),
        f"latency   {'-' if lat is None else f'{lat:.1f} ms'} from the primary's submit",
        f"flags     {', '.join(flags) or '-'}",
        f"cost      active {_usd(receipt.get('active_usd'))}, billed "
        f"{_usd(receipt.get('billed_usd'))}, wasted {_usd(receipt.get('wasted_usd'))}",
        f"created   {_when(receipt.get('created_at'))}",
        f"finished  {_when(receipt.get('finished_at'))}",
        "",
        "attempts:",
    ]
    for a in receipt.get("attempts", []):
        valid = {True: "valid", False: "invalid", None: "-"}[a.get("valid")]
        lines.append(
            f"  {a['id']} {a['role']:<8} {a['provider']:<14} {a.get('state') or '-':<11} "
            f"{valid:<7} job {a.get('job_id') or '-'}"
        )
        steps = ", ".join(f"{t:.3f}s {label}" for t, label in a.get("timeline", []))
        lines.append(f"     timeline: {steps}")
        if a.get("reasons") and a.get("valid") is False:
            lines.append(f"     reasons: {'; '.join(a['reasons'])}")
        c = a.get("cancel_receipt")
        if c:
            terminal = c.get("terminal_status") or "-"
            lines.append(
                f"     cancel: evidence {c['evidence']}, terminal {terminal},"
                f" scope {c['scope']}, leaked {str(c['leaked']).lower()}"
                + (f" ({c['note']})" if c.get("note") else "")
            )
    if receipt.get("leaks"):
        lines.append("")
        lines.append("LEAKED (may still be billing): " + ", ".join(
            f"{x['provider']} job {x['job_id']}" for x in receipt["leaks"]
        ))  # fmt: skip
    return "\n".join(lines)


@click.command(name="receipt")
@click.argument("race_id")
@click.option("--json", "as_json", is_flag=True, help="Print the full receipt as JSON.")
def command(race_id: str, as_json: bool) -> None:
    """Show the receipt of a hedged race (RACE_ID is the hedged_infer task id)."""
    from ..race.receipt import read_receipt
    from ..store.connection import translate_errors

    try:
        store = _store()
        with translate_errors():
            found = read_receipt(store, race_id)
    except ValueError as e:  # a race id that could never be a key
        raise ConfigError(str(e), key="RACE_ID") from None
    if found is None:
        raise GpuHedgeError(  # exit code 1 through the CLI's main()
            f"no race {race_id!r} under prefix {store.prefix!r} (unknown, or its receipt expired)"
        )
    click.echo(json.dumps(found, indent=2) if as_json else render(found))
